"""Kernel-level figures for scripts/gpu_check.py, and its final roofline table.

Kept apart from the model sections so each file reads in one sitting: here are
the built-in kernel comparison, the copy-bandwidth and matmul ceilings, paged
decode attention alone, and how every figure is set against its floor.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from gpu.kernels.kv_store import store_kv
from gpu.kernels.paged_decode import paged_decode_attention
from gpu.kernels.prefill import prefill_attention
from gpu.kernels.reference import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    store_kv_ref,
)

TARGETS = dict(decode_ratio=1.15, attention_fraction=0.70, prefill_fraction=0.60)


def device_time(check, fn, warmup: int = 3) -> float:
    """Seconds per call on the device timeline (CUDA events), back to back."""
    iters = check.iters
    for _ in range(warmup):
        fn()
    check.sync()
    if check.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


# --- kernels and ceilings ----------------------------------------------------------


def builtin_kernel_check(check) -> dict:
    """Each kernel at Llama-3-8B head shapes against its torch reference."""
    dev, dtype = check.device, check.dtype
    heads, kv_heads, dim, bs = (8, 2, 32, 16) if check.smoke else (32, 8, 128, 16)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    g = torch.Generator(device=dev).manual_seed(0)
    # Across pages, 64-key tiles, split partitions and 64-row query tiles; short under the
    # interpreter, which runs ~1000x slower.
    contexts, query_lens = ([1, 17, 150, 200], [1, 5, 64, 70]) if check.smoke else (
        [1, 17, 300, 700], [1, 5, 64, 130])
    blocks = sum(-(-n // bs) for n in contexts) + 4
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g, device=dev, dtype=dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g, device=dev, dtype=dtype)
    order = torch.randperm(blocks, generator=g, device=dev).to(torch.int32)
    tables = torch.zeros(len(contexts), blocks, dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(contexts):
        need = -(-n // bs)
        tables[i, :need] = order[used:used + need]
        used += need
    lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    scale = dim**-0.5
    out: dict = {}
    q = torch.randn(len(contexts), heads, dim, generator=g, device=dev, dtype=dtype)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale).float()
    for splits in (1, 4, None):
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits)
        out[f"decode_splits_{splits}_max_err"] = (got.float() - ref).abs().max().item()
    qsl = torch.tensor([0, *query_lens], device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(query_lens), heads, dim, generator=g, device=dev, dtype=dtype)
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, qsl, lens, scale).float()
    got = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(query_lens), scale)
    out["prefill_max_err"] = (got.float() - ref).abs().max().item()
    k = torch.randn(9, kv_heads, dim, generator=g, device=dev, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=g, device=dev)[:9]
    slots[[2, 7]] = -1
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, -k, expect_k, expect_v, slots)
    store_kv(k, -k, k_cache, v_cache, slots)
    out["store_exact"] = torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    errors = [v for key, v in out.items() if key.endswith("max_err")]
    out["ok"] = out["store_exact"] and max(errors) <= tol
    out["tolerance"] = tol
    return out


# --- roofline ceilings --------------------------------------------------------------


def roofline(check) -> dict:
    n = check.size["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=check.device)
    dst = torch.empty_like(src)
    copy_s = device_time(check, partial(dst.copy_, src))
    del src, dst
    m = check.size["matmul"]
    a = torch.randn(m, m, device=check.device, dtype=check.dtype)
    b, c = torch.randn_like(a), torch.empty_like(a)
    square_s = device_time(check, lambda: torch.mm(a, b, out=c))
    x = torch.randn(m, m // 2, device=check.device, dtype=check.dtype)
    w = torch.randn(m // 2, 7 * m // 4, device=check.device, dtype=check.dtype)  # an MLP's shape
    mlp_s = device_time(check, lambda: x @ w)
    square, mlp = 2 * m**3 / square_s / 1e12, 2 * m * (m // 2) * (7 * m // 4) / mlp_s / 1e12
    return {"copy_GBps": 2 * n / copy_s / 1e9,  # read + write bytes
            "matmul_TFLOPs": max(square, mlp), "matmul_square_TFLOPs": square,
            "matmul_mlp_shape_TFLOPs": mlp, "matmul_n": m}


def attention(check) -> dict:
    """Paged decode attention alone, one layer, shuffled pages: achieved bandwidth."""
    heads, kv_heads, dim, bs = (8, 2, 32, 16) if check.smoke else (32, 8, 128, 16)
    dev, dtype, rows = check.device, check.dtype, []
    for batch, context in check.size["attention"]:
        per_seq = -(-context // bs)
        k_cache = torch.randn(batch * per_seq, bs, kv_heads, dim, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(batch * per_seq, device=dev).to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, dim, device=dev, dtype=dtype)
        seconds = device_time(check, partial(paged_decode_attention, q, k_cache, v_cache,
                                             tables, lens, dim**-0.5, max_context_len=context))
        kv_bytes = 2 * batch * context * kv_heads * dim * k_cache.element_size()
        rows.append({"batch": batch, "context": context, "us": seconds * 1e6,
                     "GBps": kv_bytes / seconds / 1e9})
        del k_cache, v_cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows}


# --- the table ------------------------------------------------------------------------


def table(results: dict) -> list[dict]:
    """Each figure beside its roofline floor (or ceiling) and its target."""
    roof, rows = results.get("roofline", {}), []
    model = results["model"] if results.get("model", {}).get("ok") else results.get(
        "model_eager", {})
    bw, flops = roof.get("copy_GBps"), roof.get("matmul_TFLOPs")
    for key in ("kernels", "parity"):
        if key in results:
            rows.append({"figure": key, "verdict": "PASS" if results[key].get("ok") else "FAIL"})
    if bw and flops and model.get("ok"):
        kv_tok, layer_bytes = model["kv_bytes_per_token"], model["layer_weight_bytes"]
        head_bytes = model["lm_head_params"] * layer_bytes // model["layer_matmul_params"]
        for d in results.get("speed", {}).get("decode", []):
            kv = d["batch"] * d["context"] * kv_tok
            flop = 2 * (model["layer_matmul_params"] + model["lm_head_params"]) * d["batch"]
            floor = max((layer_bytes + head_bytes + kv) / (bw * 1e9), flop / (flops * 1e12))
            step = d["step_ms"] / 1e3
            target = d["batch"] <= 8
            rows.append({"figure": f"decode step b={d['batch']} ctx={d['context']} (ms)",
                         "measured": d["step_ms"], "floor": floor * 1e3, "ratio": step / floor,
                         "target": f"<= {TARGETS['decode_ratio']}x" if target else "",
                         "verdict": _verdict(step / floor <= TARGETS["decode_ratio"], target)})
            if "forward_ms" not in d:
                continue
            fwd_floor = max((layer_bytes + kv) / (bw * 1e9),
                            2 * model["layer_matmul_params"] * d["batch"] / (flops * 1e12))
            rows.append({"figure": f"  graph forward only b={d['batch']} (ms)",
                         "measured": d["forward_ms"], "floor": fwd_floor * 1e3,
                         "ratio": d["forward_ms"] / 1e3 / fwd_floor, "target": "", "verdict": ""})
        heads, dim, layers = model["attention_dims"]
        for p in results.get("speed", {}).get("prefill", []):
            n = p["tokens"] // p["seqs"]
            flop = (2 * model["layer_matmul_params"] * p["tokens"]
                    + 2 * p["seqs"] * n * n * heads * dim * layers)
            achieved = flop / (p["ms"] / 1e3) / 1e12
            rows.append({"figure": f"prefill {p['seqs']}x{n} tokens (TFLOP/s)",
                         "measured": achieved, "floor": flops, "ratio": achieved / flops,
                         "target": f">= {TARGETS['prefill_fraction']:.0%}",
                         "verdict": _verdict(achieved / flops >= TARGETS["prefill_fraction"])})
    if bw:
        for a in results.get("attention", {}).get("rows", []):
            frac = a["GBps"] / bw
            rows.append({"figure": f"paged decode attn b={a['batch']} ctx={a['context']} (GB/s)",
                         "measured": a["GBps"], "floor": bw, "ratio": frac,
                         "target": f">= {TARGETS['attention_fraction']:.0%}",
                         "verdict": _verdict(frac >= TARGETS["attention_fraction"])})
    return rows


def _verdict(ok: bool, applies: bool = True) -> str:
    return ("PASS" if ok else "FAIL") if applies else ""


def print_table(check, rows: list[dict]) -> None:
    roof = check.results.get("roofline", {})
    print(f"\nceilings: copy {roof.get('copy_GBps', float('nan')):.0f} GB/s, "
          f"matmul {roof.get('matmul_TFLOPs', float('nan')):.0f} TFLOP/s "
          f"(mode: {check.results['mode']})")
    print(f"{'figure':44} {'measured':>10} {'floor/ceil':>10} {'ratio':>7} {'target':>8}  verdict")
    for r in rows:
        nums = [f"{r[k]:10.3f}" if k in r else " " * 10 for k in ("measured", "floor")]
        ratio = f"{r['ratio']:7.2f}" if "ratio" in r else " " * 7
        print(f"{r['figure']:44} {nums[0]} {nums[1]} {ratio} {r.get('target', ''):>8}  "
              f"{r.get('verdict', '')}")
    failed = [k for k, v in check.results.items() if isinstance(v, dict) and not v.get("ok", 1)]
    print(f"sections failed: {failed or 'none'}; results in {check.out / 'gpu_check.json'}")
