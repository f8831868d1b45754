"""LoRA on the device: the per-row kernels, then a model's greedy ids with CUDA graphs.

kernels  `gpu/triton/lora.py` at Llama-3-8B's qkv, gate_up and down shapes (bf16, four
         slots of rank up to 16, the parts fused as `models/lora.py` fuses them): decode
         batches mixing slots, base rows (slot -1) and a slot of rank 0, and a prefill
         chunk of one adapter, against `add_lora_ref`; the kernels' device time beside
         the base linear's.
parity   a tiny random model served by `ModelRunner` with LoRA on and CUDA graphs
         captured; two adapters written in PEFT's format by hand (no peft on the GPU
         machine) and the base decode in one batch, the decode steps replayed. Each
         sequence's greedy ids must equal those of a runner whose weights have its
         adapter merged (`W + scale B A`, what PEFT's `merge_and_unload` computes), in
         float32. A decode step of the base rows alone replays the graphs without the
         LoRA kernels.

Under `--cpu-smoke` the kernels are interpreted and the runner's per-row choice, which
picks grouped torch ops on CPU, is patched to the Triton kernel for the section.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from functools import partial
from pathlib import Path

import torch
from gpu_check_common import TINY, Seqs, random_prompts, random_weights
from gpu_check_roofline import device_time
from safetensors.torch import save_file

import gpu.runner
from app.config import EngineConfig
from gpu.batch import SamplingRow
from gpu.graphs import GraphRunner
from gpu.runner import ModelRunner, RunnerSpec
from gpu.triton.lora import add_lora, rank_spans
from gpu.triton.reference import add_lora_ref
from models.lora import Target, _fuse

# (name, in, slices) at Llama-3-8B's shapes; the rank budget is 16 per slice.
SHAPES = {"gpu": [("qkv", 4096, [(0, 4096), (4096, 1024), (5120, 1024)]),
                  ("gate_up", 4096, [(0, 14336), (14336, 14336)]),
                  ("down", 14336, [(0, 4096)])],
          "smoke": [("qkv", 600, [(0, 64), (64, 32), (96, 32)]), ("down", 96, [(0, 80)])]}
ROWS = {"gpu": dict(decode=[1, 64, 256], prefill=2048),
        "smoke": dict(decode=[1, 4], prefill=8)}
MAX_RANK = 16
# Per adapter: (HF modules adapted, rank, alpha).
ADAPTERS = {1: (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                8, 16), 2: (["q_proj", "v_proj"], 4, 8)}
STEPS = {"gpu": 24, "smoke": 3}


def _slots(in_features: int, slices, dtype, device):
    """Four slots: every part (ranks 16, 9, 5...), one part, none (rank 0), two parts."""
    out = slices[-1][0] + slices[-1][1]
    budget = MAX_RANK * len(slices)
    a = torch.zeros(4, budget, in_features, dtype=dtype)
    bt = torch.zeros(4, budget, out, dtype=dtype)
    ranks, spans = [0] * 4, [[(0, 0)] * len(slices) for _ in range(4)]
    g = torch.Generator().manual_seed(0)
    parts_of = {0: {p: [16, 9, 5][p] for p in range(len(slices))}, 1: {len(slices) - 1: 3},
                3: {0: 7, len(slices) - 1: 16}}
    for slot, parts in parts_of.items():
        fused = [(Target("m", *slices[p]), torch.randn(r, in_features, generator=g) * 0.05,
                  torch.randn(slices[p][1], r, generator=g) * 0.05) for p, r in parts.items()]
        pa, pb = _fuse(fused, out, 2.0, dtype)
        a[slot, :pa.shape[0]], bt[slot, :pa.shape[0]] = pa, pb.T
        ranks[slot], spans[slot] = pa.shape[0], rank_spans(pb.T, slices)
    i32 = dict(dtype=torch.int32, device=device)
    return (a.to(device), bt.to(device), torch.tensor(ranks, **i32), torch.tensor(spans, **i32),
            torch.tensor(slices, **i32), max(s for _, s in slices), out)


def kernels(check) -> dict:
    mode = "smoke" if check.smoke else "gpu"
    dtype, device = check.dtype, check.device
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    results, ok = [], True
    for name, in_features, slices in SHAPES[mode]:
        a, bt, ranks, spans, table, max_slice, out = _slots(in_features, slices, dtype, device)
        weight = torch.randn(out, in_features, device=device, dtype=dtype) * 0.02
        cases = [(f"decode{n}", [(-1, 0, 1, 2, 3)[i % 5] for i in range(n)])
                 for n in ROWS[mode]["decode"]]
        cases.append(("prefill", [3] * ROWS[mode]["prefill"]))
        for case, slots in cases:
            rows = torch.tensor(slots, dtype=torch.int32, device=device)
            x = torch.randn(len(slots), in_features, device=device, dtype=dtype)
            y = torch.randn(len(slots), out, device=device, dtype=dtype)
            got = add_lora(y.clone(), x, a, bt, rows, ranks, spans, table, max_slice)
            want = add_lora_ref(y.clone(), x, a, bt, rows, ranks)
            err = (got.float() - want.float()).abs().max().item()
            passed = bool(torch.isfinite(got).all()) and torch.allclose(
                got.float(), want.float(), atol=tol, rtol=tol)
            ok &= passed
            kernel_s = device_time(check, partial(add_lora, y, x, a, bt, rows, ranks, spans,
                                                  table, max_slice))
            base_s = device_time(check, partial(torch.nn.functional.linear, x, weight))
            results.append({"linear": name, "case": case, "rows": len(slots), "ok": passed,
                            "max_abs_err": err, "lora_us": kernel_s * 1e6,
                            "base_linear_us": base_s * 1e6})
    return {"ok": ok, "cases": results}


def _write_adapter(out: Path, weights: dict[str, torch.Tensor], modules: list[str], r: int,
                   alpha: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT-format adapter of `weights`' model; returns each adapted HF weight with the
    adapter merged in (`W + scale B A`)."""
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules,
         "bias": "none"}))
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or module.rsplit(".", 1)[-1] not in modules:
            continue
        a = torch.randn(r, w.shape[1], generator=g) * 0.1
        b = torch.randn(w.shape[0], r, generator=g) * 0.1
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[name] = w + ((alpha / r) * b @ a).to(w.device)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return deltas


def _runner(check, model_dir: Path, weights, lora: bool) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        dtype="float32", device=check.device.type, max_model_len=128, block_size=16,
        num_blocks=64, attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=256,
        enforce_eager=False, enable_lora=lora, max_loras=2, max_lora_rank=MAX_RANK)
    runner = ModelRunner(RunnerSpec.from_config(config.flat(), model_dir=str(model_dir)),
                         weights=weights)
    if check.smoke:  # off CUDA the runner never captures: closures stand in
        runner.graphs = GraphRunner(runner.model, runner.backend, runner.k_caches,
                                    runner.v_caches, sizes=[1, 2, 4], max_model_len=128,
                                    tables=runner.tables, loras=runner.loras)
        runner.graphs.capture()
    return runner


def _greedy(runner: ModelRunner, prompts, lora_ids: list[int], steps: int) -> list[list[int]]:
    seqs = Seqs(prompts, first_block=1)
    row = SamplingRow(temperature=0.0)
    for _ in range(steps + 1):
        batch = dataclasses.replace(seqs.batch(row), lora_ids=lora_ids)
        seqs.advance(runner.execute(batch).token_ids)
    return [t[len(p):] for t, p in zip(seqs.tokens, prompts)]


def parity(check) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-lora-"))
    real_kernel = gpu.runner.row_kernel
    if check.smoke:
        gpu.runner.row_kernel = lambda device: add_lora
    try:
        cfg = dict(TINY)
        (out / "model").mkdir()
        (out / "model" / "config.json").write_text(json.dumps(cfg))
        base = dict(random_weights(cfg, check.device, torch.float32))
        merged = {i: base | _write_adapter(out / f"a{i}", base, mods, r, alpha, seed=i)
                  for i, (mods, r, alpha) in ADAPTERS.items()}
        prompts = random_prompts([5, 23, 40], cfg["vocab_size"], seed=3)
        steps, lora_ids = STEPS["smoke" if check.smoke else "gpu"], [1, 0, 2]
        runner = _runner(check, out / "model", base.items(), lora=True)
        for i in ADAPTERS:
            runner.loras.add(i, str(out / f"a{i}"))
        replays = runner.graphs.replays
        got = _greedy(runner, prompts, lora_ids, steps)
        graph_replays = runner.graphs.replays - replays
        lora_graphs, launched = runner.graphs._replay_lora, []
        for bs, replay in list(lora_graphs.items()):
            def counted(replay=replay, bs=bs):
                launched.append(bs)
                return replay()
            lora_graphs[bs] = counted
        base_only = _greedy(runner, prompts[1:2], [0], 2)[0]
        plain = _runner(check, out / "model", base.items(), lora=False)
        base_ids = [_greedy(plain, [p], [], steps)[0] for p in prompts]
        want = []
        for i, lora_id in enumerate(lora_ids):
            if lora_id:
                plain = _runner(check, out / "model", merged[lora_id].items(), lora=False)
            want.append(_greedy(plain, [prompts[i]], [], steps)[0] if lora_id else base_ids[i])
        same = [g == w for g, w in zip(got, want)]
        changed = [w != b for w, b, i in zip(want, base_ids, lora_ids) if i]
        return {"ok": all(same) and all(changed) and graph_replays >= steps and not launched
                and base_only == want[1][:3],
                "same_ids": same, "adapters_change_ids": changed,
                "graph_replays": graph_replays, "decode_steps": steps,
                "base_only_step_replayed_lora_graph": bool(launched),
                "got": got, "want": want}
    finally:
        gpu.runner.row_kernel = real_kernel
        shutil.rmtree(out, ignore_errors=True)


def lora(check) -> dict:
    """Both parts; on a kernel failure the parity still runs."""
    k = kernels(check)
    p = parity(check)
    return {"ok": k["ok"] and p["ok"], "kernels": k, "parity": p}
