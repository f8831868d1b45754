"""Correctness at real shapes: HF parity of a Llama-3-8B-shaped model, and a pool past
2**31 elements.

`hf_parity` builds HF's own `LlamaForCausalLM` (4 layers with Llama-3-8B dimensions and
llama3 RoPE scaling, random weights), hands the same tensors to a `ModelRunner` with
CUDA graphs, and compares logits over a prefill and 8 graph-path decode steps, with
HF's greedy tokens fed to both (teacher forcing). `large_pool` runs the KV store and
both attention kernels on the last blocks of a pool whose element offsets overflow
int32, against the references.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import torch
from gpu_check_common import LLAMA3_8B, TINY, Seqs, capture_logits, random_prompts

from app.config import EngineConfig
from gpu.batch import SamplingRow
from gpu.graphs import GraphRunner
from gpu.runner import ModelRunner, RunnerSpec
from gpu.triton.kv_store import store_kv
from gpu.triton.paged_decode import paged_decode_attention
from gpu.triton.prefill import prefill_attention
from gpu.triton.reference import gather_kv, paged_decode_attention_ref, prefill_attention_ref
from gpu.triton.rotary_kv_store import rotary_store_kv

FP32_LOGITS_TOL = 2e-3
NEAR_TIE = 0.1
DECODE_STEPS = 8


def _hf_model(cfg: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in cfg.items()
                            if k not in ("architectures", "model_type")},
                         initializer_range=0.02, attention_bias=False, mlp_bias=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _runner(cfg: dict, model, check, dtype: str) -> ModelRunner:
    model_dir = Path(tempfile.mkdtemp(prefix="gpu-check-hf-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig.from_kwargs(
        dtype=dtype, device=check.device.type, max_model_len=1024, block_size=16,
        num_blocks=512, attention_backend="triton", max_num_seqs=8,
        max_num_batched_tokens=2048)
    spec = RunnerSpec.from_config(config.flat(), model_dir=str(model_dir))
    runner = ModelRunner(spec, weights=((n, t) for n, t in model.state_dict().items()))
    if runner.graphs is None:  # off CUDA: closures over the static buffers stand in
        runner.graphs = GraphRunner(runner.model, runner.backend, runner.k_caches,
                                    runner.v_caches, sizes=[1, 2, 4, 8], max_model_len=1024,
                                    tables=runner.tables)
        runner.graphs.capture()
    return runner


@torch.inference_mode()
def _compare(check, cfg: dict, dtype: torch.dtype) -> dict:
    hf = _hf_model(cfg, check.device, dtype)
    runner = _runner(cfg, hf, check, str(dtype).removeprefix("torch."))
    prompts = random_prompts(check.size["hf_prompts"], cfg["vocab_size"], seed=3)
    seqs = Seqs(prompts, first_block=1)
    ours = capture_logits(runner)
    row = SamplingRow(temperature=0.0)
    replays = runner.graphs.replays
    worst, margins_ok, compared, steps = 0.0, True, 0, []
    for step in range(DECODE_STEPS + 1):
        runner.execute(seqs.batch(row))
        mine = ours[-1]
        ids = [torch.tensor([t], device=check.device) for t in seqs.tokens]
        theirs = torch.cat([hf(input_ids=i).logits[:, -1].float() for i in ids])
        diff = (mine - theirs).abs().max().item()
        worst = max(worst, diff)
        top2 = theirs.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
        same = mine.argmax(-1) == theirs.argmax(-1)
        margins_ok &= bool((same | ~decisive).all())
        compared += int(decisive.sum())
        steps.append({"step": step, "max_abs_dlogits": diff, "top1_same": int(same.sum())})
        seqs.advance(theirs.argmax(-1).tolist())  # HF's tokens for both: same history
    out = {"max_abs_dlogits": worst, "decisive_top1_compared": compared,
           "top1_equal_where_decisive": margins_ok, "graph_replays": runner.graphs.replays
           - replays, "steps": steps}
    del hf, runner, ours
    gc.collect()
    if check.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def hf_parity(check) -> dict:
    cfg = dict(TINY if check.smoke else LLAMA3_8B, num_hidden_layers=2 if check.smoke else 4)
    fp32 = _compare(check, cfg, torch.float32)
    bf16 = _compare(check, cfg, torch.bfloat16)
    return {"ok": (fp32["max_abs_dlogits"] <= FP32_LOGITS_TOL and bf16["top1_equal_where_decisive"]
                   and fp32["graph_replays"] == DECODE_STEPS == bf16["graph_replays"]),
            "fp32": fp32, "bf16": bf16, "fp32_tolerance": FP32_LOGITS_TOL}


def large_pool(check) -> dict:
    """Store, decode and prefill on the last blocks of a pool past 2**31 elements."""
    kv_heads, dim, bs, heads = (2, 32, 16, 4) if check.smoke else (8, 128, 16, 32)
    per_block = bs * kv_heads * dim
    # Off the GPU a pool that large would take the machine's memory: the smoke run
    # checks the code path on a small pool, the GPU run the int64 offsets.
    blocks = 64 if check.smoke else 2**31 // per_block + 64
    dev, dtype = check.device, check.dtype
    k_cache = torch.zeros(blocks, bs, kv_heads, dim, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator(device=dev).manual_seed(0)
    last = torch.arange(blocks - 40, blocks, device=dev, dtype=torch.int32)
    contexts = [300, 37]
    tables = torch.stack([last[:20], last[20:]])  # 20 blocks (320 slots) each
    lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    stored = True
    for seq, n in enumerate(contexts):  # fill each context with the store kernels themselves
        k = torch.randn(n, kv_heads, dim, generator=g, device=dev, dtype=dtype)
        pos = torch.arange(n, device=dev)
        slots = tables[seq].long()[pos // bs] * bs + pos % bs
        if seq == 0:
            store_kv(k, -k, k_cache, v_cache, slots)
        else:  # the fused RoPE + store of the model path (no rotation: cos 1, sin 0)
            ones = torch.ones(n, 1, dim, device=dev, dtype=dtype)
            q = torch.zeros(n, heads, dim, device=dev, dtype=dtype)
            rotary_store_kv(q, k, -k, ones, torch.zeros_like(ones), k_cache, v_cache, slots)
        stored &= torch.equal(gather_kv(k_cache, tables[seq], n), k)
        stored &= torch.equal(gather_kv(v_cache, tables[seq], n), -k)
    scale = dim**-0.5
    q = torch.randn(2, heads, dim, generator=g, device=dev, dtype=dtype)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale).float()
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, 4)
    decode_err = (got.float() - ref).abs().max().item()
    qlens = [40, 5]
    qsl = torch.tensor([0, 40, 45], dtype=torch.int32, device=dev)
    qp = torch.randn(45, heads, dim, generator=g, device=dev, dtype=dtype)
    ref = prefill_attention_ref(qp, k_cache, v_cache, tables, qsl, lens, scale).float()
    got = prefill_attention(qp, k_cache, v_cache, tables, qsl, lens, max(qlens), scale)
    prefill_err = (got.float() - ref).abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    del k_cache, v_cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"ok": stored and decode_err <= tol and prefill_err <= tol,
            "elements_per_cache": blocks * per_block, "over_int32": blocks * per_block > 2**31,
            "stored": stored, "decode_max_err": decode_err, "prefill_max_err": prefill_err,
            "tolerance": tol}
