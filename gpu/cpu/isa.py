"""A cap on the instruction sets the CPU path uses: to measure a host's other paths.

An AMX Xeon can run every CPU path Ridgeline has, but users run it on AVX-512 CPUs
without AMX (AMD Zen 4) and on AVX2-only ones (Zen 3, most desktops). `RIDGELINE_CPU_ISA`
caps what this process uses, so that one host measures and tests all three:

| value | kernels built for | oneDNN's cap | torch's | bf16 arithmetic |
| --- | --- | --- | --- | --- |
| `native` (default) | the host (`-march=native`) | none | none | where the host has it |
| `avx512` | the host without AMX | `AVX512_CORE_BF16` | `avx512` | where the host has it |
| `avx2` | Haswell's set: AVX2, FMA, F16C | `AVX2` | `avx2` | no |

(oneDNN's cap is `ONEDNN_MAX_CPU_ISA`, torch's `ATEN_CPU_CAPABILITY`.)
oneDNN and torch read their variables once, at their first use: `apply()` sets them
(unless already set) before the runner's first matmul, and a shell that sets them
itself wins. The cap is part of the kernels' build digest (their flags), so each cap
has its own cached library.
"""

from __future__ import annotations

import os

ENV = "RIDGELINE_CPU_ISA"
CAPS = ("native", "avx512", "avx2")
_NOT_NATIVE = {  # cap -> (compile flags replacing -march=native, oneDNN's cap, torch's)
    "avx512": (["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
               "AVX512_CORE_BF16", "avx512"),
    "avx2": (["-march=haswell", "-mtune=native"], "AVX2", "avx2"),
}


def cap() -> str:
    """The cap this process runs under; a value not in `CAPS` is refused, naming them."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in CAPS:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(CAPS)}")
    return value


def march_flags() -> list[str]:
    """The compile flags that choose the kernels' instruction set under the cap."""
    return _NOT_NATIVE[cap()][0] if cap() != "native" else ["-march=native"]


def bf16_allowed() -> bool:
    """Whether the cap leaves bf16 arithmetic to oneDNN (AVX2 has none)."""
    return cap() != "avx2"


def apply() -> str:
    """Cap oneDNN and torch's vector kernels as the kernels are capped; the cap's name."""
    value = cap()
    if value != "native":
        _, onednn, aten = _NOT_NATIVE[value]
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    return value
