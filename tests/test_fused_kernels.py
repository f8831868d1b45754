"""The fused elementwise kernels against their torch references, and a model built on
them against the plain-torch model.

Under `TRITON_INTERPRET=1` on CPU, natively on CUDA. References: `models.ops.DecoderOps`
(what the CPU path runs) and `rotary_store_kv_ref` (the model's own RoPE, then the
plain store).
"""

from __future__ import annotations

import pytest
import torch

from gpu.triton.decoder_ops import TritonDecoderOps
from gpu.triton.reference import rotary_store_kv_ref
from gpu.triton.rotary_kv_store import rotary_store_kv
from models.ops import DecoderOps
from models.rope import Rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@DTYPES
@pytest.mark.parametrize("hidden", [64, 72])
def test_add_rms_norm_matches_torch_and_updates_the_residual(dtype, hidden) -> None:
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(5, hidden, dtype=dtype, device=DEVICE)
    weight = torch.rand(hidden, dtype=dtype, device=DEVICE) + 0.5
    want, want_residual = DecoderOps().add_rms_norm(x, residual, weight, 1e-6)
    got, got_residual = TritonDecoderOps().add_rms_norm(x, residual, weight, 1e-6)
    assert got_residual is residual  # in place
    # fp32: the same one addition; bf16 under the interpreter truncates instead of rounding.
    exact = dtype == torch.float32 or DEVICE.type == "cuda"
    torch.testing.assert_close(got_residual, want_residual,
                               **(dict(atol=0, rtol=0) if exact else TOL[dtype]))
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(TritonDecoderOps().rms_norm(x, weight, 1e-6),
                               DecoderOps().rms_norm(x, weight, 1e-6), **TOL[dtype])


@DTYPES
def test_silu_and_mul_matches_torch(dtype) -> None:
    gate_up = torch.randn(3, 2 * 1100, dtype=dtype, device=DEVICE) * 4  # two column blocks
    torch.testing.assert_close(TritonDecoderOps().silu_and_mul(gate_up),
                               DecoderOps().silu_and_mul(gate_up), **TOL[dtype])


@DTYPES
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rotary_store_kv_matches_rope_then_store(dtype, rotary_dim) -> None:
    heads, kv_heads, dim, tokens, block_size = 6, 2, 32, 7, 4
    # q, k, v as strided views of one qkv projection, as the model produces them.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    rotary = Rotary(None, theta=10000.0, rotary_dim=rotary_dim, max_position_embeddings=64,
                    max_positions=64).to(DEVICE)
    positions = torch.tensor([3, 0, 17, 40, 41, 5, 63], device=DEVICE)
    cos, sin = rotary(positions, dtype)
    k_cache = torch.randn(6, block_size, kv_heads, dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([0, 5, -1, 9, 23, 14, -1], device=DEVICE)
    want_q, want_k, want_v = q.clone(), k_cache.clone(), v_cache.clone()
    rotary_store_kv_ref(want_q, k, v, cos, sin, want_k, want_v, slots)
    rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k_cache, want_k, **TOL[dtype])
    assert torch.equal(v_cache, want_v)  # a plain copy


def test_a_model_on_fused_kernels_matches_the_torch_model(tiny_model_dir) -> None:
    """The whole decoder: Triton backend and fused ops vs torch backend and torch ops."""
    from gpu.batch import Batch, SamplingRow
    from gpu.runner import ModelRunner, RunnerSpec

    results = []
    for backend in ("triton", "torch"):
        spec = RunnerSpec(model_dir=str(tiny_model_dir), dtype="float32", device=str(DEVICE),
                          max_model_len=128, block_size=16, kv_cache_memory=None,
                          gpu_memory_utilization=0.9, num_blocks=16, attention_backend=backend,
                          seed=0, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=64,
                          torch_threads=None)
        runner = ModelRunner(spec)
        row = SamplingRow(temperature=0.0, logprobs=3)
        prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
        batch = Batch([t for p in prompts for t in p], [*range(7), *range(3)],
                      [16 + i for i in range(7)] + [32 + i for i in range(3)], [7, 3], [7, 3],
                      [[1], [2]], [0, 1], [row, row])
        first = runner.execute(batch)
        decode = Batch(first.token_ids, [7, 3], [23, 35], [1, 1], [8, 4], [[1], [2]], [0, 1],
                       [row, row])
        results.append((first, runner.execute(decode)))
    for fused, plain in zip(*results):
        assert fused.token_ids == plain.token_ids
        for (lp_f, top_f), (lp_p, top_p) in zip(fused.logprobs, plain.logprobs):
            assert lp_f == pytest.approx(lp_p, abs=1e-4)
            assert [t for t, _ in top_f] == [t for t, _ in top_p]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from models.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("fused")
    return make_tiny_llama(root / "model", root / "no-tokenizer", vocab_size=256,
                           max_position_embeddings=256)
