"""`--int8-activations`: the C++ int8 kernels (quant_linear_int8.cpp) against a torch
reference of the same arithmetic, and the option end to end on the real SmolLM2.

The kernels quantize x per block of 32 (d = max|x| / 127, levels round(x / d) to even)
and sum the integer products exactly, so against a float64 reference that quantizes x
the same way they must agree to fp32 rounding: far tighter than the ~0.4 % that x's
quantization itself moves a result (checked too, so the reference is not vacuous).
Row counts cross the tiles (12 rows) and the row chunks (256 rows).
"""

from __future__ import annotations

import pytest
import torch

from app.config import EngineConfig
from gpu.cpu.linear import PackedLinear
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight
from tests.test_cpu_quant_kernels import (
    KERNELS,
    dequant_q4_1,
    dequant_q8_0,
    random_q4_1,
    random_q8_0,
)

needs_int8 = pytest.mark.skipif(KERNELS is None or not KERNELS.int8_linear_supported(),
                                reason="C++ CPU kernels with int8 paths (AVX512-VNNI or AVX2) "
                                "not built here")
BLOCK = 32


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def quantize_x(x: torch.Tensor, group: int = 1):
    """Levels, scales (each block's: that of its group of `group` blocks) and exact sums
    per block of 32, as the kernel computes them."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    groups = x.reshape(x.shape[0], -1, group * BLOCK)
    d = (groups.abs().amax(-1) / 127).repeat_interleave(group, -1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]), d, blocks.sum(-1)


def reference(x, levels: torch.Tensor, scales, mins=None, group: int = 1) -> torch.Tensor:
    """float64: d_w * d_x * sum(q_w q_x) [+ m_w * sum(x)] per block, summed over blocks;
    x's scale per `group` blocks."""
    q, d, sums = (t.double() for t in quantize_x(x, group))
    n = levels.shape[0]
    dots = torch.einsum("mbk,nbk->mnb", q, levels.double().view(n, -1, BLOCK))
    out = dots * d[:, None, :] * scales.double()[None]
    if mins is not None:
        out = out + mins.double()[None] * sums[:, None, :]
    return out.sum(-1)


def q4_1_levels(qweight: torch.Tensor) -> torch.Tensor:
    n = qweight.shape[0]
    blocks = qweight.view(n, -1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, -1)  # GGML order


def run(fmt: str, x: torch.Tensor, tensors: tuple) -> torch.Tensor:
    panels = PanelBlocks.of(QuantizedWeight(fmt, *tensors, *(() if fmt == "q4_1" else (None,))))
    return getattr(KERNELS, f"{fmt}_linear_int8")(x, *panels.tensors, tensors[0].shape[0])


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-6, f"relative error {err:.2e}"


@needs_int8
@pytest.mark.parametrize("m", [1, 5, 12, 13, 30, 300])
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_int8_matmul_matches_reference(m, k) -> None:
    n = 70  # the last panel's second half holds 6 outputs
    x = torch.randn(m, k)
    q4, q8 = random_q4_1(n, k), random_q8_0(n, k)
    out4, out8 = run("q4_1", x, q4), run("q8_0", x, q8)
    assert_matches(out4, reference(x, q4_1_levels(q4[0]), q4[1], q4[2]))
    assert_matches(out8, reference(x, q8[0], q8[1]))
    # x's rounding to 8 bits moves the result, as it should, by well under a percent.
    exact = x @ dequant_q4_1(*q4).T
    moved = ((out4 - exact).abs().max() / exact.abs().max()).item()
    assert 1e-5 < moved < 2e-2
    exact8 = x @ dequant_q8_0(*q8).T
    assert ((out8 - exact8).abs().max() / exact8.abs().max()).item() < 2e-2


@needs_int8
def test_int8_edge_blocks() -> None:
    """An all-zero block (scale 0), one outlier beside tiny values, levels at exact
    halves (ties to even), and a strided x (a view of wider rows)."""
    n, k = 40, 128
    x = torch.randn(4, k)
    x[0, :BLOCK] = 0
    x[1, BLOCK:2 * BLOCK] = 1e-3
    x[1, BLOCK + 5] = 300.0
    x[2, :BLOCK] = torch.arange(BLOCK) - 15.5  # d = 15.5 / 127: x / d lands near halves
    x[3] = torch.linspace(-127, 127, k) / 127 * 2.5
    wide = torch.randn(4, k + 16)
    wide[:, :k] = x
    q4, q8 = random_q4_1(n, k), random_q8_0(n, k)
    for xs in (x, wide[:, :k]):
        assert_matches(run("q4_1", xs, q4), reference(x, q4_1_levels(q4[0]), q4[1], q4[2]))
        assert_matches(run("q8_0", xs, q8), reference(x, q8[0], q8[1]))


@needs_int8
@pytest.mark.parametrize("m", [1, 2, 13, 64, 300])
def test_int8_takes_bf16_x_and_gives_bf16(m) -> None:
    """A bf16 model's prompt calls (`int8_batches`): bf16 x, widened exactly, and the
    float32 sums rounded to bf16 once, as the exact kernels do."""
    k, n = 576, 70
    x = torch.randn(m, k).bfloat16()
    for fmt, tensors in (("q4_1", random_q4_1(n, k)), ("q8_0", random_q8_0(n, k))):
        out = run(fmt, x, tensors)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, run(fmt, x.float(), tensors).bfloat16())


@needs_int8
@pytest.mark.parametrize("m", [1, 5, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [768, 2304])  # 2304: the blocks in three spans (the last short)
def test_int8_reads_the_pairs_as_it_reads_the_panels(m, dtype, k) -> None:
    """A bf16 Q4_K layer where the dot kernel is holds its levels as that kernel's pairs
    with the file's scale codes (`q4_1_pairs.h`): the int8 kernel reads them (x's levels
    in the pairs' order, `int8_pairs.h`) with float32 scales to the same bits as the
    panels, and with the codes as the reference of x scaled per super-block of 256 k
    where the kernel does so (AVX-512: `int8_k_quant_x_blocks`, as llama.cpp's Q8_K)."""
    from tests.test_cpu_q4_k_codes import read_q4_k

    n = 72
    blocks, _ = read_q4_k(n, k, seed=m)
    x = torch.randn(m, k).to(dtype)
    want = KERNELS.q4_1_linear_int8(x, *blocks.tensors, n)
    assert torch.equal(KERNELS.q4_1_linear_int8(x, blocks.dot, *blocks.tensors[1:], n), want)
    coded = KERNELS.q4_1_linear_int8(x, blocks.dot, *blocks.codes, n)
    levels = q4_1_levels(blocks.tensors[0].permute(0, 3, 1, 2).reshape(-1, k // 2)[:n])
    scales, mins = (t.permute(0, 2, 1).reshape(-1, k // BLOCK)[:n] for t in blocks.tensors[1:])
    wide = KERNELS.q4_1_linear_int8(x.float(), *blocks.tensors, n)  # bf16: its rounding
    assert_matches(wide, reference(x.float(), levels, scales, mins))
    group = KERNELS.int8_k_quant_x_blocks()
    if group == 1:
        assert torch.equal(coded, want)
        return
    assert group == 8
    wide_coded = KERNELS.q4_1_linear_int8(x.float(), blocks.dot, *blocks.codes, n)
    assert torch.equal(coded, wide_coded.to(dtype))
    assert_matches(wide_coded, reference(x.float(), levels, scales, mins, group))
    exact = x.double() @ (levels.double().view(n, -1, BLOCK) * scales.double()[..., None]
                          + mins.double()[..., None]).view(n, k).T
    err = ((wide_coded - exact).abs().max() / exact.abs().max()).item()
    assert 1e-5 < err < 3e-2  # x's rounding per 256 k moves it, within bounds


@needs_int8
@pytest.mark.parametrize("m", [1, 2, 13, 64, 300])
@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K"])
@pytest.mark.parametrize("k", [512, 2560])  # 2560: the blocks in three spans (the last short)
def test_int8_q8_16_matches_reference(m, type_name, k) -> None:
    """Q8_16 (a Q6_K's or Q3_K's levels, a scale per 16): the integer sums per half block
    exact, each scaled by its own scale, x scaled per super-block where the kernel does
    so (`int8_k_quant_x_blocks`); x's bf16 rounded once as the others'."""
    from tests.test_gguf_types import random_blocks, rewritten

    n = 70
    q = rewritten(type_name, random_blocks(type_name, n, k, seed=m), n)
    panels = PanelBlocks.of(q)
    x = torch.randn(m, k)
    out = KERNELS.q8_16_linear_int8(x, *panels.tensors, n)
    group = KERNELS.int8_k_quant_x_blocks()
    assert_matches(out, reference(x, q.dequantize(), torch.ones(n, k // BLOCK), group=group))
    exact = x @ q.dequantize().T
    assert 1e-5 < ((out - exact).abs().max() / exact.abs().max()).item() < 3e-2
    xb = x.bfloat16()
    assert torch.equal(KERNELS.q8_16_linear_int8(xb, *panels.tensors, n),
                       KERNELS.q8_16_linear_int8(xb.float(), *panels.tensors, n).bfloat16())


@needs_int8
def test_int8_bad_inputs_are_refused() -> None:
    qw, scales, mins = PanelBlocks.of(QuantizedWeight("q4_1", *random_q4_1(40, 64))).tensors
    with pytest.raises(RuntimeError, match="K = x's"):
        KERNELS.q4_1_linear_int8(torch.randn(2, 32), qw, scales, mins, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        KERNELS.q4_1_linear_int8(torch.randn(2, 64).double(), qw, scales, mins, 40)
    with pytest.raises(RuntimeError, match="N within"):
        KERNELS.q4_1_linear_int8(torch.randn(2, 64), qw, scales, mins, 80)


def test_config_refuses_int8_without_the_blocks() -> None:
    with pytest.raises(ValueError, match="cpu_quantized_matmul"):
        EngineConfig.from_kwargs(int8_activations=True, cpu_quantized_matmul=False)


def test_int8_refused_where_it_cannot_run(tiny_dir) -> None:
    """The tiny model is safetensors, not a GGUF: no blocks, so the option fails at load,
    naming itself, instead of running exact and saying nothing."""
    from app.llm import LLM

    with pytest.raises(ValueError, match="--int8-activations cannot run: .*GGUF"):
        LLM(model=str(tiny_dir), int8_activations=True, max_model_len=64)
    with pytest.raises(ValueError, match="--int8-activations cannot run: .*float32"):
        LLM(int8_activations=True, dtype="bfloat16", max_model_len=64)


@needs_int8
def test_int8_smollm2_scores_close_to_exact() -> None:
    """The real model with int8 activations: every quantized layer runs the int8 kernel
    at every row count (no packed fp32 copy kept), and its prompt logprobs stay close to
    the exact run's. On 21k tokens of prose this measured 93 % top-1 agreement and a
    median |d logprob| of 0.07 (docs/benchmarks.md); the bounds leave room for noise."""
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    text = ("The KV cache is a pool carved from the memory left after the weights, rented "
            "out in blocks; the batch is whatever fits in that pool right now, re-formed "
            "every iteration. When the pool is full a request is preempted and recomputed "
            "later. Every request carries its own sampling state, and a closed connection "
            "aborts its request and frees its blocks at once. ") * 3
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    scores = {}
    for int8 in (False, True):
        llm = LLM(int8_activations=int8, int8_batches=False, max_model_len=512)
        try:
            if int8:
                model = llm.engine.worker.wait_ready().model
                layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
                assert layers and all(m.quantized is not None and m.packed is None
                                      for m in layers)
            scores[int8] = llm.generate([text], params)[0].prompt_logprobs[1:]
        finally:
            llm.shutdown()
    pairs = list(zip(scores[False], scores[True], strict=True))
    top1 = sum(a[2][0][0] == b[2][0][0] for a, b in pairs) / len(pairs)
    deltas = sorted(abs(a[0] - b[0]) for a, b in pairs)
    assert top1 >= 0.85, top1
    assert deltas[len(deltas) // 2] < 0.15
    assert 0 < sum(deltas)  # not silently the exact path


@needs_int8
def test_peaks_time_the_int8_matmul_when_it_is_the_models_path() -> None:
    """The roofline's matmul peak is the model's own path: with int8 activations, the
    int8 kernel (which outruns fp32's FMAs), measured and cached apart from fp32's."""
    from gpu.peaks import measure_peaks

    cpu = torch.device("cpu")
    fp32 = measure_peaks(cpu, torch.float32)
    int8 = measure_peaks(cpu, torch.float32, int8_kernels=KERNELS)
    assert int8 is not fp32 and int8.flops > 0
    assert int8.dtype == "float32 with int8 activations" and fp32.dtype == "float32"
    assert measure_peaks(cpu, torch.float32, int8_kernels=KERNELS) is int8
