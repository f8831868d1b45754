"""`ridgeline bench throughput`: offline tokens/s, optionally beside HF transformers.

N random prompts × M output tokens with ignore_eos, all submitted at once. With
`--compare hf` the same prompts go through transformers' `generate` (batched,
left-padded, same dtype) in the same run, and the ratio is printed: this machine
is shared and noisy, so only side-by-side numbers mean anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from app.config import EngineConfig
from app.engine.roofline import RooflineTracker
from app.engine.sampling_params import SamplingParams
from app.llm import LLM


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_ridgeline(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    pre = llm.engine.scheduler.num_preemptions
    llm.roofline = RooflineTracker(llm.engine.peaks)  # the timed run's steps only
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    return {
        "engine": "ridgeline",
        "seconds": dt,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt,
        "requests_per_s": len(prompts) / dt,
        "preemptions": llm.engine.scheduler.num_preemptions - pre,
        # Where the steps sat against the peaks measured at start (gpu/roofline.py).
        "roofline": llm.roofline.snapshot()["since_start"],
        "peaks": llm.engine.peaks.as_dict() if llm.engine.peaks else None,
    }


def bench_hf(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], output_len: int,
             batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM  # whichever architecture config.json names

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0
    t0 = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t0
    return {
        "engine": f"hf-transformers (batch {batch_size})",
        "seconds": dt,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt,
        "requests_per_s": len(prompts) / dt,
        "preemptions": 0,
    }


def run(a: argparse.Namespace, config: EngineConfig) -> int:
    llm = LLM(config=config)
    eng = llm.engine
    prompts = make_prompts(a.num_prompts, a.input_len, eng.model_config.vocab_size, a.seed)
    rows = [bench_ridgeline(llm, prompts, a.output_len)]
    dtype = eng.dtype
    llm.shutdown()
    if a.compare == "hf":
        rows.append(bench_hf(str(eng.model_dir), getattr(torch, dtype), prompts, a.output_len,
                             a.hf_batch_size))
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "model": str(eng.model_dir),
        "dtype": dtype,
        "workload": {"num_prompts": a.num_prompts, "input_len": a.input_len,
                     "output_len": a.output_len},
        "results": rows,
    }
    if len(rows) > 1:
        result["ratio_output_tokens_per_s"] = (
            rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"]
        )
    print(f"\n{'engine':32} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} {'req/s':>7}")
    for r in rows:
        print(f"{r['engine']:32} {r['seconds']:8.2f} {r['output_tokens_per_s']:10.1f} "
              f"{r['total_tokens_per_s']:12.1f} {r['requests_per_s']:7.2f}")
    roof, peaks = rows[0]["roofline"], rows[0]["peaks"]
    if peaks:
        print(f"roofline: peaks {peaks['memory_bandwidth_gb_per_s']:.1f} GB/s, "
              f"{peaks['matmul_tflop_per_s'] * 1e3:.1f} GFLOP/s {peaks['dtype']}, ridge "
              f"{peaks['ridge_flop_per_byte']:.1f} FLOP/byte")
        for kind in ("decode", "prefill"):
            r = roof[kind]
            if r["steps"]:
                print(f"  {kind:7} {r['steps']:5d} steps {r['model_seconds']:8.2f} s  "
                      f"{r['achieved_gb_per_s']:7.2f} GB/s (MBU {r['mbu']:.1%})  "
                      f"{r['achieved_tflop_per_s'] * 1e3:7.1f} GFLOP/s (MFU {r['mfu']:.1%})  "
                      f"{r['arithmetic_intensity']:.1f} FLOP/byte")
    if "ratio_output_tokens_per_s" in result:
        print(f"ratio ridgeline / hf (output tok/s): {result['ratio_output_tokens_per_s']:.2f}x")
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0
