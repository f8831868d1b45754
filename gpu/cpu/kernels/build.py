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

Faults a machine leaves behind (`docs/robustness.md`, start-up faults): builds run under
an flock on `ridgeline.lock` in the build directory, which the kernel drops when its
holder dies, so a build killed half-way leaves nothing that blocks the next one (torch's
own lock file, which only a live holder removes, is stale by then and is deleted); a
wait for another process's build is bounded (`RIDGELINE_KERNEL_BUILD_WAIT_S`, 600 s) and
logged. A library is loaded only when it matches the digest written beside it after its
build (`NAME.so.sha256`): a truncated or foreign file is rebuilt, never mapped.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def intact(library: Path) -> bool:
    """Whether `library` is the file its build wrote (its digest beside it matches)."""
    stamp = library.with_name(library.name + ".sha256")
    try:
        return library.is_file() and stamp.read_text().strip() == _sha256(library)
    except OSError:
        return False


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """This process alone builds in `build_dir` while inside: an flock, released by the
    kernel if the holder dies. Waits at most `RIDGELINE_KERNEL_BUILD_WAIT_S` for another
    holder (TimeoutError after)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    wait = float(os.environ.get("RIDGELINE_KERNEL_BUILD_WAIT_S", "600"))
    with open(build_dir / "ridgeline.lock", "a+") as f:
        deadline, logged = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {f.name} for {wait:.0f} s "
                                       "(RIDGELINE_KERNEL_BUILD_WAIT_S)") from None
                if not logged:
                    f.seek(0)
                    log.warning("waiting for another process's kernel build (%s) in %s",
                                f.read().strip() or "pid unknown", build_dir)
                    logged = True
                time.sleep(0.2)
        f.truncate(0)
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def cpu_kernels() -> KernelOps | None:
    """The library's ops (`torch.ops.ridgeline_cpu` as `KernelOps`) once built and loaded,
    else None (reason logged once)."""
    name = f"ridgeline_cpu_{_digest()}"
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    try:
        if not intact(library):  # else built and checked by an earlier process
            with _build_lock(build_dir):
                if not intact(library):
                    _build(name, build_dir, library)
        torch.ops.load_library(str(library))
        return _loaded()
    except Exception as exc:  # no compiler, no ninja, a failed build: keep plain torch
        log.warning("C++ CPU kernels unavailable, using the torch path: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc))
        if isinstance(exc, OSError):  # where it could not write: say how to choose another
            log.warning("the kernels are built in %s; set TORCH_EXTENSIONS_DIR to a "
                        "writable directory to build them elsewhere", build_dir.parent)
        return None


def _build(name: str, build_dir: Path, library: Path) -> None:
    """Compile the library (under `_build_lock`), then write its digest beside it."""
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    if library.exists():
        log.warning("rebuilding %s: it does not match the digest of its build", library)
        library.unlink()
    # torch's own lock file: under our lock, only a build that died leaves one.
    (build_dir / "lock").unlink(missing_ok=True)
    log.info("building the C++ CPU kernels into %s (once per machine; tens of seconds)",
             build_dir)
    cpp_extension.load(
        name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
        extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
        verbose=False,
    )
    stamp = library.with_name(library.name + ".sha256")
    stamp.with_suffix(".tmp").write_text(_sha256(library))
    stamp.with_suffix(".tmp").replace(stamp)
