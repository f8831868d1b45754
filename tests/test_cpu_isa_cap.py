"""`RIDGELINE_CPU_ISA` caps the CPU path's instruction sets (`gpu/cpu/isa.py`), so that one
host tests the paths of the CPUs users have: an AVX2-capped process builds AVX2 kernels,
reports no bf16 arithmetic and no AMX, its quant kernels still give every GGUF type's
weights bit for bit, and its int8 kernels for K-quants match their reference. The capped
build is a library of its own (~1 min to compile once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.cpu import isa

ROOT = Path(__file__).resolve().parents[1]
HAS_AVX2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() \
    else False


def test_an_unknown_cap_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(isa.ENV, "sse2")
    with pytest.raises(ValueError, match="native, avx512, avx2"):
        isa.cap()
    monkeypatch.setenv(isa.ENV, "AVX2")
    assert isa.cap() == "avx2" and isa.march_flags()[0] == "-march=haswell"
    assert not isa.bf16_allowed()


@pytest.mark.skipif(not HAS_AVX2, reason="the host has no AVX2")
def test_the_avx2_cap_runs_avx2_kernels_exactly():
    env = {**os.environ, isa.ENV: "avx2"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import os; from gpu.cpu.capabilities import resolve, describe; "
         "print(describe(resolve())); print(os.environ['ONEDNN_MAX_CPU_ISA'])"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert probe.returncode == 0, probe.stderr[-2000:]
    line, onednn = probe.stdout.strip().splitlines()[-2:]
    assert line.startswith("kernels avx2") and "bf16 arithmetic no" in line \
        and "AMX no" in line, line
    assert onednn == "AVX2"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/test_gguf_types.py", "tests/test_cpu_int8_linear.py",
         "-k", "kernels_give or pairs or q8_16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:]
