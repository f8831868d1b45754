"""The AVX512-BF16 dot-product Q8_16 kernel (`q8_16_linear_bf16`: a Q6_K's or Q3_K's
levels and scales) for a bf16 model's calls of one to four rows, against the dequantized
weights and the exact kernel.

Exactness with x = one-hot rows: each output is one weight (its level times its scale,
exact in float32) times 1.0 plus zeros, so the kernel's output must be the dequantized
weight rounded to bf16, bit for bit. Random bf16 x then checks the matmul against the
exact weights in float64 (the kernel sums exact products in float32 and rounds once to
bf16: within a bf16 ulp where the float32 sum is not on a rounding boundary) and against
the exact float32 kernel's bf16 path (`q8_16_linear`, the same products summed in
another order), with N that leaves the last 32-output panel partly empty, K of one
super-block and of many, strided x; then the routing: a bf16 Q6_K layer's calls of one
to three rows take it, in the module path and in the fused decode call.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.panel_blocks import PanelBlocks
from tests.test_cpu_quant_kernels import KERNELS

HAS_OP = KERNELS is not None and hasattr(KERNELS.namespace, "q8_16_linear_bf16")
needs_op = pytest.mark.skipif(not HAS_OP, reason="no AVX512-BF16 kernel built on this CPU")


def weight(type_name: str, n: int, k: int, seed: int = 0):
    """A random Q6_K or Q3_K weight as Q8_16 blocks, and its dequantized values."""
    from tests.test_gguf_types import random_blocks, rewritten

    q = rewritten(type_name, random_blocks(type_name, n, k, seed=seed), n)
    return PanelBlocks.of(q).tensors, q.dequantize()


@needs_op
@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K"])
@pytest.mark.parametrize("n,k", [(32, 256), (45, 512)])
def test_one_hot_rows_give_each_weight_bit_for_bit(type_name, n, k) -> None:
    tensors, w = weight(type_name, n, k)
    want = w.to(torch.bfloat16)
    for rows in (1, 3, 4):
        for k0 in range(0, k, rows * 7):
            ks = [min(k0 + i, k - 1) for i in range(rows)]
            x = torch.zeros(rows, k, dtype=torch.bfloat16)
            x[torch.arange(rows), ks] = 1.0
            out = KERNELS.q8_16_linear_bf16(x, *tensors, n)
            assert torch.equal(out, want[:, ks].T), (rows, ks)


@needs_op
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(70, 256), (96, 2048)])
def test_matmul_matches_exact_weights_and_the_exact_kernel(m, n, k) -> None:
    tensors, w = weight("Q6_K", n, k, seed=m)
    x = torch.randn(m, k).to(torch.bfloat16)
    out = KERNELS.q8_16_linear_bf16(x, *tensors, n)
    exact = x.double() @ w.double().T
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7
    assert ((out.double() - exact).abs() <= ulp).all()
    fp32 = KERNELS.q8_16_linear(x, *tensors, n)
    assert ((out.double() - fp32.double()).abs() <= ulp).all()
    assert (out == fp32).float().mean() > 0.9  # mostly the same bf16 values


@needs_op
def test_x_with_a_row_stride_and_bad_inputs() -> None:
    tensors, _ = weight("Q6_K", 40, 512)
    wide = torch.randn(3, 1024).to(torch.bfloat16)
    x = wide[:, :512]
    assert torch.equal(KERNELS.q8_16_linear_bf16(x, *tensors, 40),
                       KERNELS.q8_16_linear_bf16(x.contiguous(), *tensors, 40))
    assert KERNELS.q8_16_linear_bf16(x[:0], *tensors, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="at most 4"):
        KERNELS.q8_16_linear_bf16(torch.zeros(5, 512, dtype=torch.bfloat16), *tensors, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS.q8_16_linear_bf16(torch.zeros(1, 512), *tensors, 40)
    with pytest.raises(RuntimeError, match="K = "):
        KERNELS.q8_16_linear_bf16(torch.zeros(1, 256, dtype=torch.bfloat16), *tensors, 40)


@needs_op
def test_a_bf16_q6_k_layer_takes_it_for_up_to_three_rows() -> None:
    """Where the CPU has no AMX (on AMX's CPUs the exact kernel reads the blocks quicker:
    `gpu/cpu/routing.py` `BF16_DOT_MAX_ROWS_AMX`)."""
    from gpu.cpu.routing import Route
    from tests.test_cpu_layer_call import CAPS, tiny_model

    if not CAPS.bf16_arithmetic:
        pytest.skip("a bf16 model packs for the dot kernels only with bf16 arithmetic")
    down = tiny_model(mixed=True).layers[0].mlp.down_proj  # a Q6_K layer
    assert down.quantized.format == "q8_16"
    if CAPS.amx:
        assert [down.plan.route(r) for r in (1, 2, 3)] == [Route.BLOCKS] * 3
        return
    assert [down.plan.route(r) for r in (1, 2, 3)] == [Route.BLOCKS_BF16] * 3
    assert down.plan.route(4) != Route.BLOCKS_BF16
    x = torch.randn(2, down.in_features).to(torch.bfloat16)
    assert torch.equal(down(x), KERNELS.q8_16_linear_bf16(x, *down._dot_args))
