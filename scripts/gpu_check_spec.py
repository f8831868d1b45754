"""Speculative decoding on the device: the verify kernel path, and the engine with graphs.

- `verify_kernel`: a verify step at Llama-3-8B head shapes (rows of 1 to 5 query
  tokens beside decode rows, across pages) through the Triton backend, eagerly and in
  the verify graphs' padded layout (`gpu/verify_graphs.py`: every row 1 + k tokens,
  dummies in front, dummy rows), each against `prefill_attention_ref`.
- `engine`: the offline `LLM` on a tiny random model in float32 with CUDA graphs on
  (decode and verify graphs captured by the runner itself), greedy, with n-gram
  speculation and without: the ids must be the same, or differ first where plain
  decoding's top two were within a near tie; the verify graphs must have replayed.
  The same again with the draft model (`draft_model`: the tiny model drafting for
  itself from a short window, so some guesses are wrong), whose weights and largest
  call the KV pool's plan counts (`gpu/memory.py`, `gpu/profiling.py`).

Off CUDA (`--cpu-smoke`) the runner captures nothing, so the spec run's graphs are
installed by hand, as closures, the way the model section does.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_common import TINY, random_weights
from safetensors.torch import save_file

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.batch import Batch, SamplingRow
from gpu.triton.reference import prefill_attention_ref
from gpu.verify_graphs import pad_verify_batch

NEAR_TIE = 0.1  # nats, as in the parity section
# Drafting stops from 16 running requests: all 8 prompts draft.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 16}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "draft_window": 16,
         "disable_by_batch_size": 16}  # "model": the target itself, set per run


def _inputs(slots, query_lens, context_lens, tables, dev) -> AttentionInputs:
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return AttentionInputs(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        block_tables=tables, max_query_len=max(query_lens),
        max_context_len=max(context_lens), query_lens_list=query_lens,
        context_lens_list=context_lens)


def verify_kernel(check) -> dict:
    dev, dtype = check.device, check.dtype
    heads, kv_heads, dim, bs = (8, 2, 32, 16) if check.smoke else (32, 8, 128, 16)
    row_len, bucket = 5, 8
    query = [5, 1, 3, 5, 2, 1]
    contexts = [40, 300, 17, 1000, 3, 129] if not check.smoke else [40, 100, 17, 70, 3, 33]
    g = torch.Generator(device=dev).manual_seed(5)
    blocks = sum(-(-n // bs) for n in contexts) + 1
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g, device=dev, dtype=dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g, device=dev, dtype=dtype)
    width = max(-(-n // bs) for n in contexts)
    tables, used = [], 1
    for n in contexts:
        need = -(-n // bs)
        tables.append(list(range(used, used + need)) + [0] * (width - need))
        used += need
    positions = [p for c, q in zip(contexts, query) for p in range(c - q, c)]
    slots = [tables[i][p // bs] * bs + p % bs
             for i, (c, q) in enumerate(zip(contexts, query)) for p in range(c - q, c)]
    spec = [q - 1 for q in query]
    batch = Batch(list(range(len(slots))), positions, slots, query, contexts, tables,
                  list(range(len(query))), [SamplingRow()] * len(slots), spec_lens=spec)
    table_t = torch.tensor(tables, dtype=torch.int32, device=dev)
    qkv = torch.randn(len(slots), heads + 2 * kv_heads, dim, generator=g, device=dev,
                      dtype=dtype)
    backend = TritonAttentionBackend(heads, kv_heads, dim, bs)

    def run(attn, x):
        q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = StepContext(backend, backend.prepare(attn, num_splits=1), [kc], [vc]).attend(
            0, q.clone(), k, v)
        return out, kc, vc

    eager, kc, vc = run(_inputs(slots, query, contexts, table_t, dev), qkv)
    q = qkv[:, :heads]
    ref = prefill_attention_ref(q, kc, vc, table_t, _inputs(slots, query, contexts, table_t,
                                dev).query_start_loc, table_t.new_tensor(contexts),
                                dim**-0.5).float()
    padded = pad_verify_batch(batch, bucket, row_len, padding_row=0)
    real = [t for t, s in enumerate(padded.slot_mapping) if s >= 0]
    x = torch.zeros(bucket * row_len, *qkv.shape[1:], device=dev, dtype=dtype)
    x[real] = qkv
    ptables = torch.zeros(bucket, width, dtype=torch.int32, device=dev)
    ptables[: len(query)] = table_t
    graph_out, pkc, _ = run(_inputs(padded.slot_mapping, [row_len] * bucket,
                                    padded.context_lens, ptables, dev), x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    out = {"eager_max_err": (eager.float() - ref).abs().max().item(),
           "padded_max_err": (graph_out[real].float() - ref).abs().max().item(),
           "padded_finite": bool(torch.isfinite(graph_out).all()),
           "padded_store_same": torch.equal(pkc, kc), "tolerance": tol}
    out["ok"] = (out["eager_max_err"] <= tol and out["padded_max_err"] <= tol
                 and out["padded_finite"] and out["padded_store_same"])
    return out


def _write_model(check, out: Path) -> Path:
    cfg = dict(TINY, bos_token_id=1, eos_token_id=2)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {n: t.cpu() for n, t in random_weights(cfg, check.device, torch.float32)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _generate(model: Path, check, spec: dict | None) -> dict:
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    llm = LLM(str(model), dtype="float32", device=check.device.type, max_model_len=512,
              max_num_seqs=8, skip_tokenizer_init=True, speculative_config=spec,
              attention_backend="triton",
              gpu_memory_utilization=0.3,
              **({"kv_cache_memory": 64 << 20} if check.smoke else {}))
    try:
        runner = llm.engine.worker.wait_ready()
        if check.smoke and spec is not None:  # off CUDA: closures over the static buffers
            runner.graph_sizes = [1, 2, 4]
            runner.graphs = runner._capture_graphs()
        g = torch.Generator().manual_seed(6)
        lengths = [3, 5, 8, 13] if check.smoke else [3, 5, 8, 13, 21, 2, 40, 7]
        prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() * 3
                   for n in lengths]
        params = SamplingParams(max_tokens=8 if check.smoke else 64, temperature=0.0,
                                ignore_eos=True, logprobs=2)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = runner.graphs
        verify = graphs.verify if graphs is not None else None
        total = llm.engine.speculator.total if spec is not None else None
        return {"ids": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
                "seconds": time.perf_counter() - t0,
                "decode_replays": graphs.replays if graphs else 0,
                "verify_replays": verify.replays if verify else 0,
                "verify_sizes": verify.sizes if verify else [],
                "drafts": total.num_draft_tokens if total else 0,
                "accepted": total.num_accepted_tokens if total else 0,
                "kv_blocks": runner.plan.num_blocks}
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


def engine(check) -> dict:
    """Plain decoding against n-gram speculation, and (under `draft_model`) against
    the draft model's."""
    out = Path(tempfile.mkdtemp(prefix="gpu-check-spec-"))
    try:
        model = _write_model(check, out)
        plain = _generate(model, check, None)
        spec = _generate(model, check, SPEC)
        draft = _generate(model, check, DRAFT | {"model": str(model)})
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ngram = _compare(plain, spec)
    drafted = _compare(plain, draft)
    # On CUDA the pool is sized from free memory: the draft's run has less of it.
    return ngram | {"ok": ngram["ok"] and drafted["ok"], "draft_model": drafted,
                    "kv_blocks": {"plain": plain["kv_blocks"], "draft_model": draft["kv_blocks"]}}


def _compare(plain: dict, spec: dict) -> dict:
    """Same ids, or the first difference where plain decoding's top two were within
    a near tie; the verify graphs replayed and some drafts were accepted."""
    diverged = []
    for i, (a, b) in enumerate(zip(plain["ids"], spec["ids"])):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:
            top = plain["logprobs"][i][at][1]
            diverged.append({"prompt": i, "at": at, "margin": top[0][1] - top[1][1]})
    unexcused = [d for d in diverged if d["margin"] >= NEAR_TIE]
    return {"ok": not unexcused and spec["verify_replays"] > 0 and spec["accepted"] > 0,
            "same_sequences": len(plain["ids"]) - len(diverged), "diverged": diverged,
            "unexcused": unexcused, "plain_s": plain["seconds"], "spec_s": spec["seconds"],
            **{k: spec[k] for k in ("decode_replays", "verify_replays", "verify_sizes",
                                    "drafts", "accepted")}}


def spec_decode(check) -> dict:
    """Both parts; each reports its own `ok`."""
    kernel = verify_kernel(check)
    eng = engine(check)
    return {"ok": kernel["ok"] and eng["ok"], "verify_kernel": kernel, "engine": eng}
