"""The one-shot GPU check runs, every section, in its CPU smoke mode.

It runs the way it must on the GPU machine: with the web stack, structlog, gguf and
the embedded model absent (`tests/test_bare_gpu_box.py` has the list). The figures mean
nothing on CPU; what this proves is that no section has an import or logic error
before GPU time is spent on it.
"""

from __future__ import annotations

import json

import pytest

from tests.test_bare_gpu_box import ROOT, run_bare


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_section(tmp_path):
    out = tmp_path / "check"
    proc = run_bare(f"""
import runpy
sys.path.insert(0, {str(ROOT / "scripts")!r})
sys.argv = ["gpu_check.py", "--cpu-smoke", {str(out)!r}]
runpy.run_path({str(ROOT / "scripts" / "gpu_check.py")!r}, run_name="__main__")
""", timeout=900)
    results = json.loads((out / "gpu_check.json").read_text())
    failed = {k: v.get("error", v) for k, v in results.items()
              if isinstance(v, dict) and not v.get("ok", True)}
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in ("env", "kernels", "roofline", "attention", "model", "sync_audit", "parity",
                    "bucket_sweep", "speed", "anatomy", "gil", "hf_parity", "large_pool",
                    "engine", "spec_decode", "lora", "pytest"):
        assert section in results, section
    assert results["sync_audit"]["graph_greedy_b8"]["result_waits"] == 1
    assert results["table"], "no table"
