"""What this CPU and the built C++ kernels can do, resolved once at load.

The runner resolves one `CpuCapabilities` before it builds the model and passes it
down (attention backend, decoder ops, linear layers, peaks); the code below asks it
and never probes the kernels itself. The routing of linear layers (`gpu/cpu/routing.py`)
reads only this object and the layer's shape.

`isa` is the vector width the kernels were compiled for (`-march=native`, so the
host's): `avx512` (16 float lanes), `avx2` (8, with FMA) or `portable` (plain loops).
The other facts come from the library's own queries (`vector_width`,
`int8_linear_supported`, `amx_usable`) and from oneDNN through torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gpu.cpu import isa

Isa = Literal["avx512", "avx2", "portable"]
ISA_BY_WIDTH: dict[int, Isa] = {16: "avx512", 8: "avx2", 1: "portable"}
WIDTH_BY_ISA = {isa: width for width, isa in ISA_BY_WIDTH.items()}

# The library's ops (`torch.ops.ridgeline_cpu`), as its TORCH_LIBRARY blocks register them.
OPS = (
    "paged_decode", "paged_prefill_", "paged_prefill_amx_", "paged_prefill_bf16_",
    "cascade_decode_amx_",
    "rotary_kv_store_",
    "rms_norm", "add_rms_norm_", "silu_and_mul",
    "q4_1_linear", "q8_0_linear", "q8_16_linear", "q4_1_linear_int8", "q8_0_linear_int8",
    "q8_16_linear_int8",
    "q4_1_linear_amx", "q4_1_linear_bf16", "q8_16_linear_bf16", "q4_1_dot_pairs",
    "q8_0_linear_amx",
    "q8_16_linear_amx",
    "q4_1_dequantize", "q8_0_dequantize", "q4_1_unpack", "q8_0_unpack", "q8_16_unpack",
    "argmax_rows", "sample_rows", "apply_penalties_", "apply_token_bitmask_",
    "lora_delta_", "decode_layers_bf16", "gguf_repack", "gguf_repack_panels_",
)


@functools.cache
def onednn() -> tuple[bool, bool]:
    """(oneDNN can pack linear weights, oneDNN multiplies bf16 on this CPU). It packs
    bf16 only where the CPU has bf16 arithmetic (AVX512-BF16, AMX, AVX-NE-CONVERT);
    elsewhere (AVX2, or under `RIDGELINE_CPU_ISA=avx2`) its reorder raises or is capped."""
    packing = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")
    return packing, packing and isa.bf16_allowed() \
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class CpuCapabilities:
    """One CPU's kernels and arithmetic, as the routing and the layers need them."""

    isa: Isa = "portable"
    amx: bool = False  # the AMX kernel can run: tiles built in and granted by Linux
    bf16_arithmetic: bool = False  # oneDNN packs and multiplies bf16
    int8: bool = False  # the int8 kernels have a vector path (AVX512-VNNI+VBMI, or AVX2)
    # The routing quantizes x to int8 in a bf16 model's calls of many rows (prompts,
    # decode steps of many sequences: `routing.INT8_MIN_ROWS`): where the int8 kernels
    # have a vector path, the CPU no AMX, and `--int8-batches` is on.
    int8_batches: bool = False
    onednn_packing: bool = False  # oneDNN's packed linear weights are available
    ops: frozenset[str] = frozenset()  # the C++ ops the loaded library has
    kernels: Any = field(default=None, compare=False, repr=False)  # their `KernelOps`

    @property
    def vector_width(self) -> int:
        """float32 lanes of the kernels' vector paths (1: portable loops)."""
        return WIDTH_BY_ISA[self.isa]

    def has(self, op: str) -> bool:
        return op in self.ops

    def op(self, name: str):
        """The C++ op `name`, or None where the library lacks it (or is not built)."""
        return getattr(self.kernels, name) if name in self.ops else None

    @classmethod
    def of(cls, kernels: Any) -> CpuCapabilities:
        """The capabilities of `kernels`: a `CpuCapabilities` as it is, the loaded
        library's `KernelOps` (resolved once per library), or None (no kernels: oneDNN's
        facts only)."""
        if isinstance(kernels, CpuCapabilities):
            return kernels
        return _resolve(kernels)


@functools.cache
def _resolve(kernels: Any) -> CpuCapabilities:
    packing, bf16 = onednn()
    if kernels is None:
        return CpuCapabilities(bf16_arithmetic=bf16, onednn_packing=packing)
    ops = frozenset(name for name in OPS if hasattr(kernels.namespace, name))
    return CpuCapabilities(
        isa=ISA_BY_WIDTH.get(int(kernels.vector_width()), "portable"),
        amx="q4_1_linear_amx" in ops and bool(kernels.amx_usable()),
        bf16_arithmetic=bf16,
        int8="q4_1_linear_int8" in ops and bool(kernels.int8_linear_supported()),
        onednn_packing=packing,
        ops=ops,
        kernels=kernels,
    )


def describe(capabilities: CpuCapabilities) -> str:
    """One line for the start-up log."""
    c = capabilities
    if c.kernels is None:
        return (f"no C++ kernels; oneDNN packing {'yes' if c.onednn_packing else 'no'}, "
                f"bf16 arithmetic {'yes' if c.bf16_arithmetic else 'no'}")
    capped = f" (capped: {isa.ENV}={isa.cap()})" if isa.cap() != "native" else ""
    return (f"kernels {c.isa}{capped} ({c.vector_width} float lanes), "
            f"bf16 arithmetic {'yes' if c.bf16_arithmetic else 'no'}, "
            f"int8 {'yes' if c.int8 else 'no'}{' (calls of many rows)' if c.int8_batches else ''}, "
            f"AMX {'yes' if c.amx else 'no'}, "
            f"{len(c.ops)} ops")


def resolve(use_kernels: bool = True, int8_batches: bool = False) -> CpuCapabilities:
    """This host's capabilities: with the C++ kernels built and loaded when `use_kernels`
    (the `auto` attention backend), else without them (plain torch and oneDNN), under
    the instruction-set cap of `RIDGELINE_CPU_ISA` (`gpu/cpu/isa.py`); x in int8 in
    calls of many rows where `int8_batches` asks and the CPU has int8 kernels and no AMX."""
    isa.apply()
    if not use_kernels:
        return CpuCapabilities.of(None)
    from gpu.cpu.kernels.build import cpu_kernels

    c = CpuCapabilities.of(cpu_kernels())
    return dataclasses.replace(c, int8_batches=int8_batches and c.int8 and not c.amx)
