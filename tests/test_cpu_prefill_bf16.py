"""The bf16 paged prefill kernels (`paged_prefill_amx_` on the tile unit,
`paged_prefill_bf16_` by AVX512-BF16 dot products; each where this host builds it)
against a plain torch reference and against the FMA kernel (`paged_prefill_`), and the
backend's choice between them.

Steps mix what a scheduler hands the kernel: several sequences with different cached
prefixes and new-token counts (one token, a few, more than one tile of rows), contexts
that end mid-block and cross many blocks, shuffled pages, GQA groups of 1, 3 and 8,
head_dim 32, 64 and 128, sliding windows shorter than a block and longer than several,
q a strided view of a fused projection, and rows of q/out that belong to no sequence
(they must stay untouched). The reference computes each sequence's attention in fp32
from the same bf16 values; the kernel rounds p to bf16 before p·v, as torch's bf16
attention does, so the two agree within bf16 tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.kernels.build import cpu_kernels

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
CAPS = CpuCapabilities.of(KERNELS)
# The bf16 kernels this host runs: the tile unit's where the CPU has AMX, the dot
# products' where it has AVX512-BF16 (an AMX CPU has both; an AVX2 CPU neither).
BF16_OPS = [op for op, usable in (("paged_prefill_amx_", CAPS.amx), ("paged_prefill_bf16_", True))
            if usable and CAPS.has(op)]
each_bf16_op = pytest.mark.parametrize("op", BF16_OPS or [pytest.param(
    None, marks=pytest.mark.skip(reason="needs the C++ kernels built with AVX512-BF16 or "
                                        "AMX-BF16 (an AVX2 CPU keeps the FMA kernel)"))])
ATOL = RTOL = 2e-2


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_step(prefix_lens, query_lens, block_size, num_kv_heads, group, head_dim, spare=2):
    """Pools, shuffled block tables and a strided q for one prefill step; `spare` rows of
    q/out after the sequences' rows belong to none."""
    context = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    blocks = [-(-n // block_size) for n in context]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.zeros(len(context), max(blocks), dtype=torch.int32)
    at = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = order[at:at + nb]
        at += nb
    shape = (num_kv_heads, num_blocks * block_size, head_dim)
    k_pool = torch.randn(shape, dtype=torch.bfloat16)
    v_pool = torch.randn(shape, dtype=torch.bfloat16)
    heads = num_kv_heads * group
    fused = torch.randn(sum(query_lens) + spare, heads + 2 * num_kv_heads, head_dim,
                        dtype=torch.bfloat16)
    q = fused[:, :heads]
    starts = torch.tensor([0, *query_lens[:-1]], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = (tables, starts, torch.tensor(query_lens, dtype=torch.int32),
            torch.tensor(context, dtype=torch.int32))
    return q, k_pool, v_pool, meta


def reference(q, k_pool, v_pool, meta, block_size, window):
    tables, starts, qlens, lens = meta
    group = q.shape[1] // k_pool.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s in range(len(lens)):
        n, m, s0 = int(lens[s]), int(qlens[s]), int(starts[s])
        slots = torch.tensor([int(tables[s, t // block_size]) * block_size + t % block_size
                              for t in range(n)])
        k = k_pool[:, slots].float().repeat_interleave(group, 0)
        v = v_pool[:, slots].float().repeat_interleave(group, 0)
        scores = q[s0:s0 + m].float().transpose(0, 1) @ k.transpose(1, 2) * q.shape[2] ** -0.5
        pos, key = torch.arange(n - m, n)[:, None], torch.arange(n)[None]
        seen = (key <= pos) & ((key > pos - window) if window else True)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[s0:s0 + m] = (probs @ v).transpose(0, 1)
    return out


def run(op, q, k_pool, v_pool, meta, block_size, window):
    out = torch.full(q.shape, 7.0, dtype=q.dtype)  # rows of no sequence must keep it
    op(out, q, k_pool, v_pool, *meta, block_size, q.shape[2] ** -0.5, window)
    return out


STEPS = [  # prefix lens, query lens, block size, kv heads, group, head_dim, window
    ([0, 16, 700, 5], [1, 37, 64, 130], 16, 3, 3, 64, 0),
    ([768] * 3, [64] * 3, 16, 3, 3, 64, 0),
    ([0, 31, 100], [200, 3, 17], 32, 2, 8, 128, 0),
    ([3, 250], [90, 21], 16, 4, 1, 32, 0),
    ([0, 300, 40], [70, 33, 1], 16, 3, 3, 64, 7),
    ([500, 0], [40, 150], 16, 3, 3, 64, 100),
]


@each_bf16_op
@pytest.mark.parametrize("step", STEPS, ids=lambda s: f"{s[1]}-bs{s[2]}-g{s[4]}-d{s[5]}-w{s[6]}")
def test_bf16_prefill_matches_the_reference_and_the_fma_kernel(op, step) -> None:
    prefix, qlens, block_size, kv_heads, group, head_dim, window = step
    q, k_pool, v_pool, meta = make_step(prefix, qlens, block_size, kv_heads, group, head_dim)
    bf16 = run(getattr(KERNELS, op), q, k_pool, v_pool, meta, block_size, window)
    fma = run(KERNELS.paged_prefill_, q, k_pool, v_pool, meta, block_size, window)
    ref = reference(q, k_pool, v_pool, meta, block_size, window)
    rows = sum(qlens)
    torch.testing.assert_close(bf16[:rows].float(), ref[:rows], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(bf16[:rows], fma[:rows], atol=ATOL, rtol=RTOL)
    assert (bf16[rows:] == 7.0).all()


@each_bf16_op
def test_bf16_prefill_reads_no_key_outside_its_context_or_window(op) -> None:
    """NaN in the rest of a sequence's last block, in other requests' blocks and in
    blocks wholly before the window must not reach the result."""
    block_size, window = 16, 20
    q, k_pool, v_pool, meta = make_step([40, 0], [9, 21], block_size, 3, 3, 64, spare=0)
    args = (block_size, window)
    clean = run(getattr(KERNELS, op), q, k_pool, v_pool, meta, *args)
    tables, _, _, lens = meta
    # Sequence 0: keys 0..48, its first new token (position 40) sees keys from 21 on, so
    # block 0 is out of every row's window. Sequence 1: keys 0..20, its block 1 ends at 20.
    for pool in (k_pool, v_pool):
        for s, n in enumerate(lens.tolist()):
            last = int(tables[s, (n - 1) // block_size])
            tail = -n % block_size  # slots of the last block past the context
            pool[:, (last + 1) * block_size - tail:(last + 1) * block_size] = float("nan")
        pool[:, int(tables[0, 0]) * block_size:(int(tables[0, 0]) + 1) * block_size] = float("nan")
        used = {int(b) for s, n in enumerate(lens.tolist())
                for b in tables[s, :-(-n // block_size)]}
        for b in set(range(pool.shape[1] // block_size)) - used:
            pool[:, b * block_size:(b + 1) * block_size] = float("nan")
    poisoned = run(getattr(KERNELS, op), q, k_pool, v_pool, meta, *args)
    assert torch.equal(poisoned, clean) and not clean.isnan().any()


@each_bf16_op
@pytest.mark.parametrize("dtype,head_dim,match", [(torch.float32, 64, "bfloat16"),
                                                  (torch.bfloat16, 48, "multiple of 32")])
def test_bf16_prefill_rejects_what_it_does_not_take(op, dtype, head_dim, match) -> None:
    q, k_pool, v_pool, meta = make_step([0], [4], 16, 1, 1, head_dim)
    q, k_pool, v_pool = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    with pytest.raises(RuntimeError, match=match):
        run(getattr(KERNELS, op), q, k_pool, v_pool, meta, 16, 0)


AMX_AND_DOT = ("paged_decode", "paged_prefill_", "paged_prefill_amx_", "paged_prefill_bf16_")


@pytest.mark.parametrize("amx,ops,dtype,head_dim,expected", [
    (True, AMX_AND_DOT, torch.bfloat16, 64, "paged_prefill_amx_"),
    (True, AMX_AND_DOT, torch.float32, 64, "paged_prefill_"),
    (True, AMX_AND_DOT, torch.bfloat16, 48, "paged_prefill_"),
    (False, AMX_AND_DOT, torch.bfloat16, 64, "paged_prefill_bf16_"),  # AMX not granted
    (False, AMX_AND_DOT[:2] + AMX_AND_DOT[3:], torch.bfloat16, 64, "paged_prefill_bf16_"),
    (False, AMX_AND_DOT[:2] + AMX_AND_DOT[3:], torch.float32, 64, "paged_prefill_"),
    (False, AMX_AND_DOT[:2], torch.bfloat16, 64, "paged_prefill_"),  # AVX2: neither
])
def test_backend_prefills_bf16_with_the_cpus_bf16_products(amx, ops, dtype, head_dim,
                                                            expected) -> None:
    """Which prefill kernel runs is decided from the capabilities alone (a recording
    stand-in for the library, so this runs on any host)."""
    calls = []

    def recorder(name):
        return lambda *args: calls.append(name)

    kernels = SimpleNamespace(**{name: recorder(name) for name in ops})
    caps = CpuCapabilities(isa="avx512", amx=amx, ops=frozenset(ops), kernels=kernels)
    backend = TorchAttentionBackend(9, 3, head_dim, 16, kernels=caps)
    q, k_pool, v_pool, meta = make_step([0, 5], [4, 6], 16, 3, 3, head_dim)
    q, k_pool, v_pool = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    group = SimpleNamespace(max_query_len=6, block_tables=meta[0], query_starts=meta[1],
                            query_lens=meta[2], context_lens=meta[3], identity=False)
    step = SimpleNamespace(slot_mapping=torch.zeros(0, dtype=torch.long), groups=[group],
                           num_tokens=q.shape[0])
    nothing = torch.zeros(0, 3, head_dim, dtype=dtype)  # no new keys to store
    backend.forward(q, nothing, nothing, k_pool, v_pool, step)
    assert calls == [expected]


@each_bf16_op
@pytest.mark.parametrize("window", [0, 100])
def test_bf16_prefill_splits_a_long_prompt_into_runs_for_the_threads(op, window) -> None:
    """With few sequences for the threads, a sequence's tiles are split into runs that
    each pack the keys they see: the result must not depend on the thread count."""
    q, k_pool, v_pool, meta = make_step([300], [400], 16, 3, 3, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 8):  # one run; then several (4 x 8 threads over 3 units)
            torch.set_num_threads(n)
            outs.append(run(getattr(KERNELS, op), q, k_pool, v_pool, meta, 16, window))
    finally:
        torch.set_num_threads(threads)
    ref = reference(q, k_pool, v_pool, meta, 16, window)
    torch.testing.assert_close(outs[1][:400].float(), ref[:400], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)
