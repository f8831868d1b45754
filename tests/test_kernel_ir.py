"""The kernels compile for Hopper (sm_90) with no spills, and the decode kernel keeps two
K/V tiles in flight: Triton's own compiler and ptxas, offline, no GPU needed
(`scripts/kernel_ir.py`, in a fresh interpreter: kernels made under TRITON_INTERPRET
cannot be compiled). Skipped where the Triton install has no NVIDIA toolchain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="no ptxas in this triton install")


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_ir.py"), "--json"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_kernel_spills_registers(compiled):
    spills = {name: (r["spill_stores"], r["spill_loads"]) for name, r in compiled.items()}
    assert all(s == (0, 0) for s in spills.values()), spills


def test_decode_keeps_two_kv_tiles_in_flight_and_four_ctas_fit_an_sm(compiled):
    decode = compiled["paged_decode"]
    assert decode["buffer_depth"] == 2 and decode["async_copies"] > 0, decode
    assert decode["shared_bytes"] <= 57 * 1024 and decode["registers"] <= 128, decode


def test_prefill_double_buffers_its_key_tiles(compiled):
    assert all(compiled[k]["buffer_depth"] >= 2 for k in ("prefill_64", "prefill_128"))
