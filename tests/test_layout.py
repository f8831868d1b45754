"""The rooms' import rules (docs/architecture.md), their floors, the size rule, and the
light client install.

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
    "gpu/cpu": ("app", "gpu.triton", "triton"),
    "gpu/triton": ("app", "gpu.cpu"),
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


# Floors of the model thread and below, lowest first: a module imports only from its own
# room or from a lower floor, so the rooms of one floor never import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("models",),
    ("gpu.roofline",),  # the cost model: plain numbers, shared by every floor above
    ("gpu.cpu", "gpu.triton"),  # the kernels of each device, and what routes them
    ("gpu.attention",),
    ("gpu",),  # the worker, the runner, the sampler, the graphs, the memory plan
)


def room_of(module: str) -> tuple[int, str] | None:
    """(floor, room) of the most specific room `module` is in, None outside them."""
    best = None
    for floor, rooms in enumerate(FLOORS):
        for room in rooms:
            if breaks(module, room) and (best is None or len(room) > len(best[1])):
                best = (floor, room)
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_modules() -> dict[str, set[str]]:
    """Module name -> the modules of the floors it imports (lazy imports too)."""
    found = {}
    for room in ("gpu", "models"):
        for path in sorted((ROOT / room).rglob("*.py")):
            found[module_name(path)] = {m for m in imports_of(path) if room_of(m)}
    return found


def test_imports_run_from_higher_floors_to_lower():
    """`gpu/` and `models/`: each import goes down a floor or stays in its room (the CPU
    room never reaches for Triton, nor either for the runner)."""
    found = []
    for module, imported in floor_modules().items():
        here = room_of(module)
        for other in sorted(imported):
            there = room_of(other)
            if there[1] != here[1] and there[0] >= here[0]:
                found.append(f"{module} (floor {here[0]}) imports {other} (floor {there[0]})")
    assert not found, "\n".join(found)


def test_no_import_cycles():
    """No cycle among the modules of `gpu/` and `models/`, lazy imports included."""
    graph = floor_modules()
    edges = {m: {o for o in graph if o != m and any(breaks(i, o) for i in imported)
                 and not breaks(m, o)}
             for m, imported in graph.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for o in sorted(edges[m]):
            if state.get(o) == 1:
                return [*path, m, o]
            if o not in state and (cycle := visit(o, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m, [])):
            pytest.fail(" -> ".join(cycle))


# Past ~400 lines a file is two files; a file named here is one concept that says why it
# is longer, until it is split.
SIZE_EXCEPTIONS: dict[str, int] = {}
SIZE_SUFFIXES = (".py", ".cpp", ".h")


def test_no_file_over_the_size_limit():
    """One concept per file: past ~400 lines a file is two files (Python and C++ alike)."""
    long = {name: n for room in ("app", "gpu", "models")
            for p in (ROOT / room).rglob("*") if p.suffix in SIZE_SUFFIXES
            if (n := len(p.read_text().splitlines())) > SIZE_EXCEPTIONS.get(
                name := str(p.relative_to(ROOT)), 420)}
    assert not long, long
    gone = [name for name in SIZE_EXCEPTIONS if not (ROOT / name).exists()]
    assert not gone, f"exceptions for files that no longer exist: {gone}"


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
