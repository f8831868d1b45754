"""What the KV pool must leave room for on CUDA: peak activations and CUDA graphs.

After the weights load, one dummy step at the largest shape the scheduler may
form (max_num_batched_tokens tokens over up to max_num_seqs sequences, every
sequence sampled with top-p, min-p and logprobs, the sampler's most hungry
path) runs on a tiny temporary KV pool; the allocator's peak above what was
allocated before it is the activation peak. The graphs' share is measured the
same way, with a decode step at the largest capture size (the graphs' shared
pool holds about that step's activations), plus a fixed allowance per graph.
With a draft model (speculative decoding's `draft_model`), its largest call (one
window of tokens, then its guesses) is measured too: it runs between steps on the same
thread, so the activations to leave room for are the larger of the two peaks.
`gpu/memory.py` then subtracts both from the budget.

The measurement is a step of the real model, so nothing about its activations
is guessed. Off CUDA the steps still run (to test this code) and report 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionBackend, AttentionInputs, StepContext
from gpu.batch import SamplingRow
from gpu.sampler import Sampler

log = logging.getLogger("ridgeline.profiling")

GiB = 1 << 30
# Per captured graph, besides the shared pool: kernel nodes, their parameters,
# the split workspace. A cautious guess until the GPU check calibrates it (it
# logs the estimate next to the measured figure).
GRAPH_OVERHEAD_BYTES = 4 << 20
# The sampler's most memory-hungry path: a full sort for top-p without top-k, min-p,
# log-softmax and a top-k for logprobs.
HUNGRY_ROW = SamplingRow(temperature=1.0, top_p=0.9, min_p=0.05, logprobs=20)


@dataclass(frozen=True)
class MemoryProfile:
    peak_activation_bytes: int
    graph_bytes: int


def profile_query_lens(max_num_batched_tokens: int, max_num_seqs: int,
                       max_model_len: int) -> list[int]:
    """The largest step: the token budget spread evenly over as many sequences as
    allowed, none longer than max_model_len."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    return [min(base + (i < extra), max_model_len) for i in range(num_seqs)]


def _measure(device: torch.device, step: Callable[[], object]) -> int:
    """Bytes the allocator's peak rose above what was allocated before `step`."""
    if device.type != "cuda":
        step()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _dummy_step(model, backend: AttentionBackend, query_lens: list[int], device, dtype):
    """A fresh-prefill step where every sequence shares one tiny pool of pages.

    All sequences (and all layers) write and read the same few blocks: the
    contents are garbage, the shapes and hence the activations are real.
    """
    width = -(-max(query_lens) // backend.block_size)
    k_cache = torch.zeros(backend.kv_cache_shape(width), dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.cat([torch.arange(n) for n in query_lens]).to(device)
    qsl = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    inputs = AttentionInputs(
        slot_mapping=positions,  # the block table is 0..width-1, so slot == position
        query_start_loc=qsl,
        context_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(width, dtype=torch.int32, device=device).repeat(
            len(query_lens), 1),
        max_query_len=max(query_lens),
        max_context_len=max(query_lens),
        query_lens_list=query_lens,
        context_lens_list=query_lens,
    )
    layers = model.config.num_layers
    ctx = StepContext(backend, backend.prepare(inputs), [k_cache] * layers, [v_cache] * layers)
    input_ids = torch.zeros(len(positions), dtype=torch.long, device=device)
    return input_ids, positions, ctx, qsl


@torch.inference_mode()
def profile_memory(
    model,
    backend: AttentionBackend,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    graph_sizes: list[int],
    draft_call: Callable[[], object] | None = None,
) -> MemoryProfile:
    """Run the dummy steps (and `draft_call`, the draft model's largest call) and
    return the bytes to keep free of the KV pool."""
    query_lens = profile_query_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    ids, positions, ctx, qsl = _dummy_step(model, backend, query_lens, device, dtype)
    sampler = Sampler(device)

    def largest_step():
        hidden = model(ids, positions, ctx)
        logits = model.compute_logits(hidden[qsl[1:].long() - 1])
        sampler(logits, [HUNGRY_ROW] * len(query_lens))

    peak = _measure(device, largest_step)
    draft_peak = 0 if draft_call is None else _measure(device, draft_call)
    graph_bytes = 0
    if graph_sizes:
        d_ids, d_pos, d_ctx, _ = _dummy_step(model, backend, [1] * graph_sizes[-1], device, dtype)
        decode_peak = _measure(device, lambda: model(d_ids, d_pos, d_ctx))
        graph_bytes = decode_peak + len(graph_sizes) * GRAPH_OVERHEAD_BYTES
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the pool is carved out next: hand the profile's blocks back
    log.info(
        "Memory profile: a %d-token step over %d sequences peaks at %.2f GiB of activations; "
        "CUDA graphs for %d step shapes estimated at %.2f GiB",
        sum(query_lens), len(query_lens), peak / GiB, len(graph_sizes), graph_bytes / GiB,
    )
    if draft_call is not None:
        log.info("Memory profile: the draft model's largest call peaks at %.2f GiB of "
                 "activations (between steps: the larger peak is kept)", draft_peak / GiB)
    return MemoryProfile(max(peak, draft_peak), graph_bytes)
