"""The routing of CPU linear calls (`gpu/cpu/routing.py`): representative shapes on
representative CPUs, each with the kernel it must get. Pure: no kernels are built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu.cpu.capabilities import OPS, CpuCapabilities
from gpu.cpu.routing import (
    INT8_MIN_ROWS,
    LinearLayer,
    LinearShape,
    Route,
    choose_route,
    plan_routes,
)

F32, BF16 = torch.float32, torch.bfloat16
WITH_AMX = frozenset(OPS)
NO_AMX = WITH_AMX - {"q4_1_linear_amx", "q8_0_linear_amx"}

# A Xeon with AMX; an AVX-512 CPU with AVX512-BF16 (Zen 4-like); an AVX-512 one without
# bf16 arithmetic; an AVX2 one; a build with portable loops only; no C++ kernels at all.
AMX = CpuCapabilities("avx512", amx=True, bf16_arithmetic=True, int8=True,
                      onednn_packing=True, ops=WITH_AMX)
AVX512_BF16 = CpuCapabilities("avx512", bf16_arithmetic=True, int8=True, onednn_packing=True,
                              ops=NO_AMX)
AVX512 = dataclasses.replace(AVX512_BF16, bf16_arithmetic=False)
AVX2 = CpuCapabilities("avx2", int8=True, onednn_packing=True, ops=NO_AMX)
PORTABLE = CpuCapabilities("portable", onednn_packing=True, ops=NO_AMX)
NO_KERNELS = CpuCapabilities(bf16_arithmetic=True, onednn_packing=True)

B, I8, AMX_, PLAIN, PACKED, WIDE = (Route.BLOCKS, Route.BLOCKS_INT8, Route.AMX, Route.PLAIN,
                                    Route.PACKED, Route.WIDENED)
DOT = Route.BLOCKS_BF16
NO_DOT = dataclasses.replace(AVX512_BF16, ops=NO_AMX - {"q4_1_linear_bf16"})

# (capabilities, weight dtype, blocks' format, int8 activations, rows, route)
TABLE = [
    # fp32 with Q4_1 / Q8_0 blocks: the blocks up to a row count set by the vector width.
    (AVX512_BF16, F32, "q4_1", False, 1, B),
    (AVX512_BF16, F32, "q4_1", False, 192, B),
    (AVX512_BF16, F32, "q4_1", False, 193, PACKED),
    (AVX512_BF16, F32, "q8_0", False, 48, B),
    (AVX512_BF16, F32, "q8_0", False, 49, PACKED),
    (AMX, F32, "q4_1", False, 64, B),  # AMX serves bf16 models only
    (AMX, F32, "q4_1", False, 2048, PACKED),
    (AVX2, F32, "q4_1", False, 96, B),
    (AVX2, F32, "q4_1", False, 97, PACKED),
    (AVX2, F32, "q8_0", False, 32, B),
    (AVX2, F32, "q8_0", False, 33, PACKED),
    # Portable loops never take the blocks; without blocks, fp32's few rows go plain.
    (PORTABLE, F32, "q4_1", False, 1, PLAIN),
    (PORTABLE, F32, "q4_1", False, 4, PACKED),
    (NO_KERNELS, F32, "q4_1", False, 3, PLAIN),
    (AVX512_BF16, F32, None, False, 1, PLAIN),
    (AVX512_BF16, F32, None, False, 3, PLAIN),
    (AVX512_BF16, F32, None, False, 4, PACKED),
    # int8 activations: the int8 kernels for every call.
    (AVX512_BF16, F32, "q4_1", True, 1, I8),
    (AVX512_BF16, F32, "q8_0", True, 4096, I8),
    (AVX2, F32, "q4_1", True, 128, I8),
    (AVX512_BF16, F32, "q8_16", True, 64, I8),
    # ... but AVX2's Q8_16 int8 kernel gains up to ~100 rows only: oneDNN's above.
    (AVX2, F32, "q8_16", True, 96, I8),
    (AVX2, F32, "q8_16", True, 97, PACKED),
    (PORTABLE, F32, "q4_1", True, 1, PLAIN),  # no blocks there, so no int8 either
    (AVX512_BF16, F32, None, True, 64, PACKED),
    # bf16 with bf16 arithmetic: the widened blocks for the fewest rows, then oneDNN's bf16.
    (AVX512_BF16, BF16, "q4_1", False, 1, DOT),
    (AVX512_BF16, BF16, "q4_1", False, 3, DOT),
    (AVX512_BF16, BF16, "q4_1", False, 4, B),
    (NO_DOT, BF16, "q4_1", False, 1, B),  # a library built without AVX512-BF16
    (AVX512_BF16, BF16, "q8_16", False, 1, DOT),  # a Q6_K's levels: their own dot kernel
    (AMX, BF16, "q8_16", False, 1, B),  # not on AMX's CPUs: their vdpbf16ps is slower
    (AVX512_BF16, BF16, "q4_1", True, 1, DOT),  # int8 needs a float32 multiply
    (AVX512_BF16, BF16, "q4_1", True, 4, B),
    (AMX, F32, "q4_1", False, 1, B),  # the dot product is for bf16 x only
    (AVX512, BF16, "q4_1", False, 1, B),  # widened: a float32 multiply
    (AVX512_BF16, BF16, "q4_1", False, 6, B),
    (AVX512_BF16, BF16, "q4_1", False, 7, PACKED),
    (AVX512_BF16, BF16, "q8_0", False, 1, B),
    (AVX512_BF16, BF16, "q8_0", False, 2, PACKED),
    (AVX512_BF16, BF16, None, False, 1, PACKED),
    (AVX512_BF16, BF16, "q4_1", True, 1, DOT),  # int8 needs a float32 multiply: exact
    # ... and with AMX: the tile unit for the middle rows, the Q8_0 LM head's from two.
    (AMX, BF16, "q4_1", False, 1, DOT),  # the fewest rows: the bf16 dot-product kernel
    (AMX, BF16, "q4_1", False, 3, DOT),
    (AMX, BF16, "q4_1", False, 4, AMX_),
    (AMX, BF16, "q4_1", False, 128, AMX_),
    (AMX, BF16, "q4_1", False, 129, PACKED),
    (AMX, BF16, "q8_0", False, 1, B),
    (AMX, BF16, "q8_0", False, 2, AMX_),
    (AMX, BF16, "q8_0", False, 96, AMX_),
    (AMX, BF16, "q8_0", False, 97, PACKED),
    (AMX, F32, "q8_0", False, 48, B),  # a float32 head: never the tile unit
    (dataclasses.replace(AMX, ops=WITH_AMX - {"q8_0_linear_amx"}), BF16, "q8_0", False, 2,
     PACKED),  # a library without the Q8_0 op: oneDNN past the widened row
    # bf16 without bf16 arithmetic: widened, float32's thresholds.
    (AVX2, BF16, "q4_1", False, 96, B),
    (AVX2, BF16, "q4_1", False, 97, WIDE),
    (AVX2, BF16, None, False, 3, PLAIN),
    (AVX2, BF16, None, False, 4, WIDE),
    (AVX512, BF16, "q4_1", False, 192, B),
    (AVX512, BF16, "q8_0", False, 49, WIDE),
]


@pytest.mark.parametrize(("capabilities", "dtype", "blocks", "int8", "rows", "route"), TABLE)
def test_route(capabilities, dtype, blocks, int8, rows, route):
    shape = LinearShape(rows, LinearLayer(dtype, blocks, int8))
    assert choose_route(shape, capabilities) == route


def test_plan_holds_only_what_its_routes_need():
    """Every call on the blocks (int8): no packed weight; otherwise one is kept."""
    assert not plan_routes(LinearLayer(F32, "q4_1", True), AVX2).packed
    assert plan_routes(LinearLayer(F32, "q4_1"), AVX2).packed
    assert not plan_routes(LinearLayer(F32, None), AVX2).blocks
    assert plan_routes(LinearLayer(BF16, "q4_1"), AMX).amx_rows is not None


# A bf16 model's calls of many rows without AMX (`int8_batches`, on by default where the
# CPU can): int8 x from `INT8_MIN_ROWS` rows (prompts, decode steps of that many
# sequences), fewer rows as before, blocks held alone; a float32 model keeps the exact
# kernels.
PROMPT_TABLE = [
    (AVX512_BF16, BF16, "q4_1", INT8_MIN_ROWS - 1, DOT),  # the dot kernel up to there
    (AVX512_BF16, BF16, "q4_1", INT8_MIN_ROWS, I8),
    (AVX512_BF16, BF16, "q4_1", 16, I8),  # a decode step of 16 users
    (AVX512_BF16, BF16, "q8_16", INT8_MIN_ROWS - 1, DOT),  # Q6_K's dot kernel too
    (AVX512_BF16, BF16, "q8_16", INT8_MIN_ROWS, I8),
    (AVX512_BF16, BF16, "q8_0", 10**6, I8),
    (AVX512_BF16, BF16, "q8_16", 10**6, I8),
    # AVX2's int8 kernel for Q8_16 is for a decode call's rows only: a prompt's is exact.
    (AVX2, BF16, "q8_16", 4096, Route.UNPACKED),
    (AVX512_BF16, F32, "q4_1", INT8_MIN_ROWS, B),  # float32: the exact path
    (AVX2, BF16, "q4_1", INT8_MIN_ROWS - 1, B),  # widened: a float32 multiply
    (AVX2, BF16, "q4_1", 4096, I8),  # before the unpacked route
    (AVX2, F32, "q4_1", 4096, Route.UNPACKED),
    (AVX2, BF16, "q8_0", INT8_MIN_ROWS, I8),
    (AVX512_BF16, BF16, None, 4096, Route.PACKED),  # no blocks, no int8
    (PORTABLE, F32, "q4_1", 4096, Route.PACKED),  # no int8 kernels (nor blocks)
]


@pytest.mark.parametrize(("capabilities", "dtype", "blocks", "rows", "route"), PROMPT_TABLE)
def test_prompt_route(capabilities, dtype, blocks, rows, route):
    on = dataclasses.replace(capabilities, int8_batches=capabilities.int8)
    shape = LinearShape(rows, LinearLayer(dtype, blocks, blocks_only=blocks is not None))
    assert choose_route(shape, on) == route
    # Off (`--no-int8-batches`, or a CPU with AMX): the exact kernels take every call.
    assert choose_route(shape, capabilities) != I8


def test_amx_keeps_prompts_exact():
    """The tile unit is faster than int8 there: `resolve` never turns it on with AMX, and
    a layer with an AMX route never takes int8 for its prompts."""
    on = dataclasses.replace(AMX, int8_batches=True)
    layer = LinearLayer(BF16, "q4_1", blocks_only=True)
    assert choose_route(LinearShape(4096, layer), on) == AMX_
