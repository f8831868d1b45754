"""Kernel-level figures for scripts/gpu_check.py, and its final roofline table.

Kept apart from the model sections so each file reads in one sitting: here are
the built-in kernel comparison, the copy-bandwidth and matmul ceilings, paged
decode attention alone, and how every figure is set against its floor.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from gpu.triton.kv_store import store_kv
from gpu.triton.paged_decode import choose_num_splits, paged_decode_attention
from gpu.triton.prefill import prefill_attention
from gpu.triton.reference import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    store_kv_ref,
)

TARGETS = dict(decode_ratio=1.15, attention_fraction=0.70, prefill_fraction=0.60)
ATTENTION_TARGETED = {(1, 32768), (8, 16384)}  # long contexts; the rest for information


def device_time(check, fn, warmup: int = 3) -> float:
    """Seconds per call on the device timeline (CUDA events), back to back."""
    iters = check.iters
    for _ in range(1 if check.smoke else warmup):
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
    out |= fused_kernel_errors(check, heads, kv_heads, dim, k_cache, v_cache, g)
    errors = [v for key, v in out.items() if key.endswith("max_err")]
    relative = [v for key, v in out.items() if key.endswith("rel_err")]
    rel_tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    out["ok"] = out["store_exact"] and max(errors) <= tol and max(relative) <= rel_tol
    out["tolerance"], out["relative_tolerance"] = tol, rel_tol
    return out


def fused_kernel_errors(check, heads, kv_heads, dim, k_cache, v_cache, g) -> dict:
    """The fused elementwise kernels at Llama-3-8B widths against plain torch."""
    from gpu.triton.decoder_ops import TritonDecoderOps
    from gpu.triton.reference import rotary_store_kv_ref
    from gpu.triton.rotary_kv_store import rotary_store_kv
    from models.ops import DecoderOps
    from models.rope import Rotary

    dev, dtype = check.device, check.dtype
    hidden, inter = (128, 256) if check.smoke else (4096, 14336)
    x = torch.randn(7, hidden, generator=g, device=dev, dtype=dtype)
    res = torch.randn(7, hidden, generator=g, device=dev, dtype=dtype)
    w = torch.rand(hidden, generator=g, device=dev, dtype=dtype) + 0.5
    want, _ = DecoderOps().add_rms_norm(x, res, w, 1e-5)
    got, _ = TritonDecoderOps().add_rms_norm(x, res.clone(), w, 1e-5)
    gate_up = torch.randn(7, 2 * inter, generator=g, device=dev, dtype=dtype)
    qkv = torch.randn(9, heads + 2 * kv_heads, dim, generator=g, device=dev, dtype=dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    rope = Rotary(dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=8192),
                  theta=500000.0, rotary_dim=dim, max_position_embeddings=131072,
                  max_positions=4096).to(dev)
    cos, sin = rope(torch.randint(0, 4096, (9,), generator=g, device=dev), dtype)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], generator=g, device=dev)[:9]
    want_q, want_k, want_v = q.clone(), k_cache.clone(), v_cache.clone()
    rotary_store_kv_ref(want_q, k, v, cos, sin, want_k, want_v, slots)
    rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)

    def rel(got, want):  # elementwise outputs reach |x| ~ 4, where a bf16 ulp is 0.03
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    return {"add_rms_norm_rel_err": rel(got, want),
            "silu_and_mul_rel_err": rel(TritonDecoderOps().silu_and_mul(gate_up),
                                        DecoderOps().silu_and_mul(gate_up)),
            "rotary_store_q_rel_err": rel(q, want_q),
            "rotary_store_k_rel_err": rel(k_cache, want_k)}


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
    return {"rows": rows, "mixed": mixed_decode_rows(check, heads, kv_heads, dim, bs)}


def mixed_decode_rows(check, heads: int, kv_heads: int, dim: int, bs: int) -> dict:
    """Decode rows of a mixed batch (beside one prefill row): through the decode kernel
    as the backend routes them now, against a decode-only batch and against the prefill
    kernel that used to take them (one query row in a 64-row tile, per query head)."""
    n, context, prefill_len = check.size["mixed"]
    dev, dtype = check.device, check.dtype
    per_seq = -(-context // bs)
    k_cache = torch.randn((n + 1) * per_seq, bs, kv_heads, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm((n + 1) * per_seq, device=dev).to(torch.int32).view(n + 1, -1)
    lens = torch.tensor([prefill_len] + [context] * n, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, prefill_len, *range(prefill_len + 1, prefill_len + n + 1)],
                       dtype=torch.int32, device=dev)
    q = torch.randn(prefill_len + n, heads, dim, device=dev, dtype=dtype)
    scale, splits = dim**-0.5, choose_num_splits(n, kv_heads, context)
    mixed = device_time(check, partial(paged_decode_attention, q, k_cache, v_cache, tables, lens,
                                       scale, splits, query_start_loc=qsl))
    alone = device_time(check, partial(paged_decode_attention, q[prefill_len:], k_cache, v_cache,
                                       tables[1:], lens[1:], scale, splits))
    ones = torch.arange(n + 1, dtype=torch.int32, device=dev)
    by_prefill = device_time(check, partial(prefill_attention, q[prefill_len:], k_cache, v_cache,
                                            tables[1:], ones, lens[1:], 1, scale))
    return {"decode_rows": n, "context": context, "mixed_us": mixed * 1e6,
            "decode_only_us": alone * 1e6, "prefill_kernel_us": by_prefill * 1e6,
            "mixed_vs_decode_only": mixed / alone, "prefill_kernel_vs_mixed": by_prefill / mixed}


# --- the table ------------------------------------------------------------------------


def table(results: dict) -> list[dict]:
    """Each figure beside its roofline floor (or ceiling) and its target."""
    roof, rows = results.get("roofline", {}), []
    model = results["model"] if results.get("model", {}).get("ok") else results.get(
        "model_eager", {})
    bw, flops = roof.get("copy_GBps"), roof.get("matmul_TFLOPs")
    for key in ("kernels", "sync_audit", "parity", "bucket_sweep", "anatomy", "gil", "hf_parity",
                "large_pool", "engine", "pytest"):
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
    rows += host_figures(results)
    if bw:
        for a in results.get("attention", {}).get("rows", []):
            frac = a["GBps"] / bw
            targeted = (a["batch"], a["context"]) in ATTENTION_TARGETED
            rows.append({"figure": f"paged decode attn b={a['batch']} ctx={a['context']} (GB/s)",
                         "measured": a["GBps"], "floor": bw, "ratio": frac,
                         "target": f">= {TARGETS['attention_fraction']:.0%}" if targeted else "",
                         "verdict": _verdict(frac >= TARGETS["attention_fraction"], targeted)})
    return rows


def host_figures(results: dict) -> list[dict]:
    """Syncs per step, GPU idle time, the GIL's cost, the engine's tokens/s."""
    rows = []
    audit = results.get("sync_audit", {}).get("graph_greedy_b8", {})
    if audit.get("syncs") is not None:
        rows.append({"figure": "host-device syncs per greedy graph step", "measured":
                     audit["syncs"], "floor": 1, "target": "<= 1",
                     "verdict": _verdict(audit["syncs"] <= 1)})
    for a in results.get("anatomy", {}).get("rows", []):
        if a.get("idle_fraction") is not None:
            target = a["batch"] >= 64
            rows.append({"figure": f"GPU idle b={a['batch']} ({a['kernels_per_step']:.0f} "
                         "kernels/step)", "measured": a["idle_fraction"],
                         "target": "<= 15%" if target else "",
                         "verdict": _verdict(a["idle_fraction"] <= 0.15, target)})
    gil = results.get("gil", {})
    for name in ("default_5ms", "ridgeline"):
        if name in gil:
            mine = name == "ridgeline"
            rows.append({"figure": f"GIL slowdown beside busy Python ({name})",
                         "measured": gil[name]["slowdown"], "target": "<= 10%" if mine else "",
                         "verdict": _verdict(gil[name]["slowdown"] <= 0.10, mine)})
    mixed = results.get("attention", {}).get("mixed")
    if mixed:
        rows.append({"figure": "mixed-batch decode rows: prefill kernel / decode",
                     "measured": mixed["prefill_kernel_vs_mixed"], "target": "", "verdict": ""})
    eng = results.get("engine", {})
    for name in ("graphs", "enforce_eager"):
        if name in eng:
            rows.append({"figure": f"engine {name}: out tok/s (step ms)",
                         "measured": eng[name]["tokens_per_s"],
                         "floor": eng[name]["mean_step_ms"], "target": "", "verdict": ""})
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
