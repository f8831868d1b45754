"""The memory plan and the roofline as one report: `GET /plan` on a running server, and
`ridgeline plan` for a model that is not served (the "grep kv cache" question answered
before the GPU is rented).

The report holds the KV plan's arithmetic (weights, KV bytes per token, pool, tokens,
blocks, concurrency at max_model_len: `gpu/memory.py`), the model's cost per step
(`gpu/roofline.py`), the device's peaks (measured at start, or given), where typical
steps would sit on that roofline (decode at a few batch sizes, one prefill chunk), and,
on a server, where the steps actually sat (`app/engine/roofline.py`).

Without a device, `offline_plan` sizes the pool the way the model thread would: from
`--kv-cache-memory` (CPU: 1 GiB by default), `--num-gpu-blocks-override`, or a planned
GPU's memory (`device_memory` × `--gpu-memory-utilization` − weights). The last is an
upper bound: the activation peak and the CUDA graphs are measured on the device at start.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from app.config import CacheConfig, EngineConfig
from gpu.memory import GiB, KVPlan, plan_kv_cache
from gpu.roofline import DevicePeaks, ModelCost, QuantizedReads, StepCost, flop_rate
from models.config import ModelConfig


def resolve_max_model_len(model_config: ModelConfig, requested: int | None) -> int:
    """The served length: what was asked for (within the model's context), else the
    model's whole context (vLLM's default; the KV plan lowers it, and says so, where the
    pool cannot hold one sequence of it: `gpu/memory.py` `plan_kv_cache`)."""
    model_max = model_config.max_context_len
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len={requested} exceeds what the model allows: "
                         f"{model_config.context_note}")
    return requested


def cache_config_info(cache: CacheConfig, plan: KVPlan, dtype: str) -> dict[str, str]:
    """vLLM's `cache_config_info` labels (its CacheConfig field names, values as str) for
    the fields Ridgeline has; `cache_dtype` is the dtype served, not "auto"."""
    return {"block_size": str(plan.block_size), "cache_dtype": dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
            "num_gpu_blocks": str(plan.num_blocks),
            "num_gpu_blocks_override": str(cache.num_blocks),
            "kv_cache_size_tokens": str(plan.token_capacity),
            "kv_cache_max_concurrency": f"{plan.max_concurrency:.2f}",
            "sliding_window": str(plan.sliding_window)}


def memory_section(plan: KVPlan) -> dict[str, Any]:
    return {"weights_bytes": plan.weights_bytes, "weights_gib": round(plan.weights_bytes / GiB, 3),
            "kv_bytes_per_token": plan.bytes_per_token, "kv_cache_bytes": plan.kv_bytes,
            "kv_cache_gib": round(plan.kv_bytes / GiB, 3), "block_size": plan.block_size,
            "num_blocks": plan.num_blocks, "kv_cache_tokens": plan.token_capacity,
            "max_model_len": plan.max_model_len,
            "max_concurrency": round(plan.max_concurrency, 2),
            "sliding_window": plan.sliding_window}


def _row(step: str, cost: StepCost, tokens: int, peaks: DevicePeaks | None) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "flops": cost.flops, "bytes": cost.bytes,
                           "arithmetic_intensity": round(cost.intensity, 2)}
    if peaks is not None:
        floor = peaks.floor_seconds(cost)
        row |= {"bound": "memory" if cost.intensity < peaks.ridge else "compute",
                "floor_ms": round(floor * 1e3, 3), "tokens_per_s_ceiling": round(tokens / floor)}
    return row


def expected_steps(cost: ModelCost, peaks: DevicePeaks | None, max_num_seqs: int,
                   max_num_batched_tokens: int, max_model_len: int) -> dict[str, Any]:
    """Where typical steps would sit: decode at a few batch sizes (each sequence at half
    of max_model_len), and one prefill chunk of the step's token budget."""
    context = max(1, max_model_len // 2)
    batches = sorted({b for b in (1, 8, 32, 64, max_num_seqs) if b <= max_num_seqs})
    rows = [_row(f"decode batch {b}", cost.decode(b, context), b, peaks) for b in batches]
    chunk = min(max_num_batched_tokens, max_model_len)
    rows.append(_row(f"prefill {chunk} tokens", cost.prefill(chunk), chunk, peaks))
    return {"decode_context": context, "steps": rows}


def plan_report(*, model: str, model_config: ModelConfig, dtype: str, device: str,
                plan: KVPlan, cost: ModelCost, peaks: DevicePeaks | None, max_num_seqs: int,
                max_num_batched_tokens: int, notes: list[str] | None = None) -> dict[str, Any]:
    return {
        "model": {"name": model, "architecture": model_config.describe(),
                  "parameters": cost.total_params, "dtype": dtype, "device": device},
        "memory": memory_section(plan),
        "cost_per_step": {"matmul_flops_per_token": 2 * cost.matmul_params,
                          "lm_head_flops_per_row": 2 * cost.head_params,
                          "attention_flops_per_query_key_pair": cost.attention_flops_per_pair,
                          "weight_bytes_per_step": (cost.layer_params + cost.head_params)
                          * cost.dtype_bytes,
                          "kv_bytes_per_token": cost.kv_bytes_per_token},
        "peaks": peaks.as_dict() if peaks is not None else None,
        "roofline": expected_steps(cost, peaks, max_num_seqs, max_num_batched_tokens,
                                   plan.max_model_len),
        "notes": notes or [],
    }


@dataclass(frozen=True)
class FileReads(QuantizedReads):
    """`QuantizedReads` estimated from a GGUF's blocks before they are read (every call
    reads them where a layer holds no dense copy), with what they stand for in all."""

    bytes: int = 0  # every kept weight's blocks, the embedding's included
    params: int = 0  # the weights those blocks stand for


def file_reads(blocks, tied: bool) -> FileReads | None:
    """What the served layers read, by the file's bytes (None: no blocks kept)."""
    if not blocks:
        return None
    sources, embed = blocks.sources, "model.embed_tokens.weight"
    head = sources.get(embed if tied else "lm_head.weight")
    layers = [s for name, s in sources.items() if name not in (embed, "lm_head.weight")]
    return FileReads(
        layer_bytes=sum(s.nbytes for s in layers), head_bytes=head.nbytes if head else 0,
        layer_max_rows=sys.maxsize, head_max_rows=sys.maxsize if head else 0,
        layer_params=sum(s.in_features * s.out_features for s in layers),
        bytes=sum(s.nbytes for s in sources.values()),
        params=sum(s.in_features * s.out_features for s in sources.values()))


def offline_plan(config: EngineConfig, device_memory: int | None = None,
                 peaks: DevicePeaks | None = None, measure_peaks: bool = False
                 ) -> dict[str, Any]:
    """The report for a model that is not served: config.json and the settings alone
    (plus a measurement of this machine's peaks when asked)."""
    import torch

    from gpu.dtypes import (
        DTYPES,
        choose_dtype,
        kv_cache_dtype_asked,
        resolve_device,
        resolve_kv_dtype,
    )
    from models import gguf_blocks
    from models.resolve import resolve_model

    notes = []
    if device_memory is not None:  # planning a GPU this machine may not have
        device, total = torch.device("cuda"), device_memory
        dtype = torch.bfloat16 if config.dtype == "auto" else DTYPES[config.dtype]
        notes.append(f"planned for a GPU of {device_memory / GiB:.1f} GiB: the pool is an upper "
                     "bound (activations and CUDA graphs are measured on the device at start)")
    else:
        device = resolve_device(config.device)
        dtype = choose_dtype(config.dtype, device,
                             int8_activations=config.flat()["int8_activations"])[0]
        total = (torch.cuda.get_device_properties(device).total_memory
                 if device.type == "cuda" and not (config.cache.kv_cache_memory
                                                   or config.cache.num_blocks) else None)
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = resolve_model(config.model, dtype_name)
    model_config = ModelConfig.from_dir(model_dir)
    max_model_len = resolve_max_model_len(model_config, config.max_model_len)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    kv_dtype = resolve_kv_dtype(kv_cache_dtype_asked(config.cache.kv_cache_dtype, config.dtype,
                                                     dtype, device), dtype, device)
    kv_dtype_bytes = torch.tensor([], dtype=kv_dtype).element_size()
    # A GGUF's layers on CPU are served from the file's blocks, no dense copy beside them.
    served = device.type == "cpu" and config.flat()["cpu_quantized_matmul"]
    reads = file_reads(gguf_blocks.load(model_dir),
                       model_config.tie_word_embeddings) if served else None
    cost = ModelCost.from_config(model_config, dtype_bytes, blocks=reads)
    weights_bytes = cost.weights_bytes - (reads.params * dtype_bytes - reads.bytes
                                          if reads is not None else 0)
    cache = config.cache
    plan = plan_kv_cache(
        bytes_per_token=model_config.kv_bytes_per_token(kv_dtype_bytes),
        block_size=cache.block_size, max_model_len=max_model_len,
        weights_bytes=weights_bytes, kv_cache_memory=cache.kv_cache_memory,
        num_blocks=cache.num_blocks, total_device_bytes=total,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        sliding_window=model_config.uniform_window,
        fit_max_model_len=config.max_model_len is None)
    cost = ModelCost.from_config(model_config, dtype_bytes, plan.sliding_window, reads,
                                 kv_dtype_bytes=kv_dtype_bytes)
    if reads is not None:
        notes.append("weights and steps' reads count the GGUF's blocks at the file's size "
                     "(the layouts the kernels read can take more: a served model logs them)")
    if measure_peaks and peaks is None:
        if device_memory is not None:
            raise ValueError("--measure-peaks measures this machine: it cannot be combined "
                             "with --device-memory (give --peak-bandwidth-gbps/--peak-tflops)")
        from gpu.peaks import measure_peaks as measure

        if device.type == "cpu" and config.torch_threads:  # as the model thread would run
            torch.set_num_threads(config.torch_threads)
        peaks = measure(device, dtype, cost.weights_bytes)
    sched = config.scheduler
    return plan_report(model=config.model_name, model_config=model_config, dtype=dtype_name,
                       device=str(device), plan=plan, cost=cost, peaks=peaks,
                       max_num_seqs=sched.max_num_seqs,
                       max_num_batched_tokens=sched.max_num_batched_tokens, notes=notes)


def format_plan(report: dict[str, Any]) -> str:
    """The report as the lines an operator reads (and greps: "KV cache")."""
    m, mem, peaks = report["model"], report["memory"], report["peaks"]
    lines = [f"Model: {m['name']}: {m['architecture']}; {m['parameters'] / 1e6:.1f}M "
             f"parameters, {m['dtype']} on {m['device']}",
             f"Model weights take {mem['weights_gib']:.2f} GiB",
             f"KV cache bytes per token: {mem['kv_bytes_per_token']}",
             f"Available KV cache memory: {mem['kv_cache_gib']:.2f} GiB",
             f"KV cache size: {mem['kv_cache_tokens']} tokens ({mem['num_blocks']} blocks of "
             f"{mem['block_size']})",
             f"Maximum concurrency for {mem['max_model_len']} tokens per request: "
             f"{mem['max_concurrency']:.2f}x"]
    if peaks:
        lines.append(f"Device peaks: {peaks['memory_bandwidth_gb_per_s']:.1f} GB/s, "
                     f"{flop_rate(peaks['matmul_tflop_per_s'] * 1e12)} {peaks['dtype']}; ridge at "
                     f"{peaks['ridge_flop_per_byte']:.1f} FLOP/byte ({peaks['how']})")
    else:
        lines.append("Device peaks: not known (--measure-peaks on this machine, or "
                     "--peak-bandwidth-gbps and --peak-tflops)")
    roof = report["roofline"]
    lines.append(f"Roofline (decode sequences at context {roof['decode_context']}):")
    for row in roof["steps"]:
        line = (f"  {row['step']:<24} {row['bytes'] / GiB:8.3f} GiB {row['flops'] / 1e9:10.1f} "
                f"GFLOP {row['arithmetic_intensity']:8.1f} FLOP/byte")
        if "floor_ms" in row:
            line += (f"  {row['bound']}-bound, at best {row['floor_ms']:.2f} ms, "
                     f"{row['tokens_per_s_ceiling']} tokens/s")
        lines.append(line)
    lines += [f"Note: {n}" for n in report["notes"]]
    return "\n".join(lines)
