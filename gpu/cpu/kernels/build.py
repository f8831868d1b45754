"""Build and load the C++ CPU kernels once per machine; None when they cannot be built.

`torch.utils.cpp_extension.load` compiles the `.cpp` files here with the host's own
instruction set (-march=native, or what `RIDGELINE_CPU_ISA` caps it to: `gpu/cpu/isa.py`)
into a cache directory, so only the first process on a
machine pays the compile (`benchmarks/first_start.sh` times it with the rest of a fresh
machine's first start). The library's name carries a digest of everything the
binary depends on: the sources and headers, the flags, the CPU's model and feature
flags (a cache shared by different CPUs never hands one a binary built for another),
and the torch and Python versions. A library of that name is therefore the build, and
later processes load it with `torch.ops.load_library` without importing cpp_extension
(which imports setuptools: ~0.2 s of every server's start).

-ffp-contract=off keeps a written multiply and add two roundings (GCC would fuse them,
even across intrinsics), as the rotary kernel's bit-for-bit agreement with the torch
path and the vector exp's with its scalar twin need; explicit FMA intrinsics stay FMAs.

The kernels are a speed-up, never a requirement: without a compiler (or ninja), or
when the build fails, the caller keeps the plain torch path and the reason is logged
once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from gpu.cpu import isa

log = logging.getLogger("ridgeline.cpu_kernels")

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
FLAGS = ["-O3", *isa.march_flags(), "-fopenmp", "-fopenmp-simd", "-ffp-contract=off"]


def cache_dir() -> Path:
    """Where the library is built: `$TORCH_EXTENSIONS_DIR`, as for any torch extension,
    else beside the converted models in `~/.cache/ridgeline`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "ridgeline" / "cpu_kernels"


def _digest() -> str:
    """A short digest of what the built library depends on (see the module's docstring)."""
    text = "".join(p.read_text() for p in sorted(HERE.glob("*.[ch]*")))
    text += " ".join(FLAGS) + platform.machine() + torch.__version__ + sys.version
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features")):
                text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:10]


ISAS = {16: "AVX-512", 8: "AVX2"}


class KernelOps:
    """`torch.ops.ridgeline_cpu`, each op bound to its one overload on first use. Called
    through the namespace, every call looks the overload up again in Python, a cost of
    the same order as a one-row kernel's own, and a one-row decode step makes a few
    hundred such calls. Missing ops raise AttributeError, as there. Which ops exist is
    read once, into `gpu.cpu.capabilities.CpuCapabilities`."""

    def __init__(self, namespace):
        self.namespace = namespace

    def __getattr__(self, name: str):
        op = getattr(self.namespace, name).default
        setattr(self, name, op)  # found by plain attribute lookup from now on
        return op


def _loaded():
    """The loaded ops, once their vector paths are logged: on a CPU without AVX2 only the
    portable loops are built, and some of them lose to torch's own (gpu/cpu/routing.py)."""
    ops = KernelOps(torch.ops.ridgeline_cpu)
    width = ops.vector_width()
    log.info("C++ CPU kernels: %s", f"{ISAS[width]} ({width} float lanes)" if width in ISAS
             else "portable loops only (this CPU has neither AVX-512 nor AVX2 with FMA)")
    return ops


@functools.cache
def cpu_kernels() -> KernelOps | None:
    """The library's ops (`torch.ops.ridgeline_cpu` as `KernelOps`) once built and loaded,
    else None (reason logged once)."""
    name = f"ridgeline_cpu_{_digest()}"
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    try:
        # Built by an earlier process, and not being rebuilt by a concurrent one (torch's
        # build holds a lock file in the directory until the library is complete).
        if library.is_file() and not (build_dir / "lock").exists():
            torch.ops.load_library(str(library))
            return _loaded()
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        log.info("building the C++ CPU kernels into %s (once per machine; tens of seconds)",
                 build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
            extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
            verbose=False,
        )
        return _loaded()
    except Exception as exc:  # no compiler, no ninja, a failed build: keep plain torch
        log.warning("C++ CPU kernels unavailable, using the torch path: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc))
        return None
