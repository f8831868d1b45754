"""The rooms' import rules (docs/architecture.md), and the light client install.

The rules are read from the source with `ast`, imports inside functions included,
so a lazy import cannot slip a forbidden dependency past them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HTTP = ("starlette", "sse_starlette", "uvicorn", "httptools")
# room → module prefixes its files must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "app/engine": (*HTTP, "app.server", "app.client", "app.bench", "app.llm", "app.cli"),
    "app/client": ("app.engine", "app.server", "app.bench", "app.llm", "app.cli", "app.config",
                   "gpu", "models", "torch", "triton", "transformers"),
    "app/server": ("gpu", "app.bench", "app.llm", "app.cli"),
    "gpu": ("app",),
    "models": ("gpu", "app"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def breaks(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_keep_their_import_rules(room):
    files = sorted((ROOT / room).rglob("*.py"))
    assert files, f"no files under {room}"
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files
        for module in sorted(imports_of(path))
        if any(breaks(module, p) for p in FORBIDDEN[room])
    ]
    assert not found, "\n".join(found)


def test_product_code_never_imports_tests():
    found = [str(p.relative_to(ROOT)) for room in ("app", "gpu", "models", "scripts")
             for p in (ROOT / room).rglob("*.py")
             if any(breaks(m, "tests") for m in imports_of(p))]
    assert not found


def test_no_file_over_the_size_limit():
    """One concept per file: past ~400 lines a file is two files."""
    long = {str(p.relative_to(ROOT)): n for room in ("app", "gpu", "models")
            for p in (ROOT / room).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


CHECK_LIGHT = """
import json, sys
from pathlib import Path
import app.client
from app.cli import main
url, out = sys.argv[1], Path(sys.argv[2])
code = main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--input-len", "16",
             "--output-len", "4", "--ignore-eos", "--max-concurrency", "2", "--no-plots",
             "--result-dir", str(out), "--metrics-interval", "0.1"])
assert code == 0, code
r = json.loads((out / "serve.json").read_text())
assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 16, r
heavy = sorted(m for m in ("torch", "transformers", "triton", "starlette", "structlog", "tqdm")
               if m in sys.modules)
assert not heavy, heavy
try:
    import torch  # noqa: F401
except ImportError:
    print("LIGHT-OK")
"""


@pytest.mark.slow
def test_base_install_is_the_client_without_torch(tmp_path, tiny_dir):
    """A fresh virtualenv with `pip install .` (no extra): the SDK and `bench serve` run a
    real benchmark against a running server, and torch is neither installed nor imported."""
    from tests.server_harness import ServerThread, tiny_config

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(ROOT)],
                             capture_output=True, text=True, env=env, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=4)).start()
    try:
        run = subprocess.run([str(python), "-c", CHECK_LIGHT, srv.url, str(tmp_path / "out")],
                             capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
        assert "Successful requests" in run.stdout
        assert run.stdout.rstrip().endswith("LIGHT-OK")
        cli = subprocess.run([str(env_dir / "bin" / "ridgeline"), "bench", "serve",
                              "--base-url", srv.url, "--num-prompts", "2", "--output-len", "3",
                              "--no-plots", "--result-dir", str(tmp_path / "cli")],
                             capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert cli.returncode == 0, (cli.stdout[-2000:], cli.stderr[-2000:])
        assert json.loads((tmp_path / "cli" / "serve.json").read_text())["completed"] == 2
    finally:
        srv.stop()
    assert sys.prefix != str(env_dir)
