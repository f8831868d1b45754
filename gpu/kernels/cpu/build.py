"""Build and load the C++ CPU kernels once per machine; None when they cannot be built.

`torch.utils.cpp_extension.load` compiles the `.cpp` files here with the host's own
instruction set (-march=native) into torch's extension cache and reuses it while the
source and flags are unchanged, so only the first process on a machine pays the
~30 s compile; later ones load the cached library in well under a second. The
library's name carries a digest of the CPU's feature flags, so a cache directory
shared by different CPUs never hands one a binary built for another (and of the
headers, whose changes torch would not notice). -ffp-contract=off keeps a written
multiply and add two roundings (GCC would fuse them, even across intrinsics), as the
quantized kernels' exact dequantization needs; explicit FMA intrinsics stay FMAs.

The kernels are a speed-up, never a requirement: without a compiler (or ninja), or
when the build fails, the caller keeps the plain torch path and the reason is logged
once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import SimpleNamespace

import torch

log = logging.getLogger("ridgeline.cpu_kernels")

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-ffp-contract=off"]


def _digest() -> str:
    """A short digest of the CPU model and feature flags, and of the headers (torch
    tracks the sources' changes, not those of what they include), for the name."""
    text = platform.machine() + "".join(p.read_text() for p in sorted(HERE.glob("*.h")))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features")):
                text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@functools.cache
def cpu_kernels() -> SimpleNamespace | None:
    """`torch.ops.ridgeline_cpu` once built and loaded, else None (reason logged once)."""
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        log.info("loading the C++ CPU kernels (built once per machine, cached)")
        cpp_extension.load(
            name=f"ridgeline_cpu_{_digest()}", sources=[str(p) for p in SOURCES],
            extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
            verbose=False,
        )
        return torch.ops.ridgeline_cpu
    except Exception as exc:  # no compiler, no ninja, a failed build: keep plain torch
        log.warning("C++ CPU kernels unavailable, using the torch path: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc))
        return None
