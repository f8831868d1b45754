"""Start-up faults a machine leaves behind, made for real (`docs/robustness.md`): a kernel
build killed half-way (torch's lock file left in the build directory), a build held by
another process, a truncated library in the cache, SIGTERM while the model loads, and a
cache that cannot be written (no permission, no space). Each ends in a start or a clear
exit, never a hang or a crash."""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from gpu.cpu.kernels import build
from tests.server_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
LOAD = ("from gpu.cpu.kernels.build import cpu_kernels; import sys; "
        "sys.exit(0 if cpu_kernels() is not None else 3)")

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or build.cpu_kernels() is None,
                                reason="needs the C++ CPU kernels built here")


def built_copy(tmp_path: Path) -> Path:
    """This machine's built library directory, copied into a cache of its own: the
    faults below are made there, never in the real cache."""
    name = f"ridgeline_cpu_{build._digest()}"
    assert build.intact(build.cache_dir() / name / f"{name}.so")
    shutil.copytree(build.cache_dir() / name, tmp_path / name)
    return tmp_path / name


def load_in(cache: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), **env})


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_start(tmp_path):
    """torch's lock file, left as a build killed mid-way leaves it: the next process
    loads the built library at once (it waited forever before)."""
    directory = built_copy(tmp_path)
    (directory / "lock").touch()
    done = load_in(tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_build_held_by_another_process_is_waited_for_within_a_bound(tmp_path):
    """Another live process holds the build lock and the library must be rebuilt: the wait
    is bounded and logged, and the start goes on without the kernels."""
    directory = built_copy(tmp_path)
    (directory / f"{directory.name}.so.sha256").write_text("not this library")
    with open(directory / "ridgeline.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        done = load_in(tmp_path, timeout=60, RIDGELINE_KERNEL_BUILD_WAIT_S="1")
    assert done.returncode == 3 and time.monotonic() - t0 < 30
    assert "waiting for another process's kernel build" in done.stderr
    assert "RIDGELINE_KERNEL_BUILD_WAIT_S" in done.stderr


def test_a_truncated_library_is_never_mapped(tmp_path):
    """The cached library cut short (a full disk, a killed copy): its digest no longer
    matches, so it is rebuilt, never loaded; here no compiler is on the PATH, so the
    start goes on without the kernels and says why (it died of SIGBUS before)."""
    directory = built_copy(tmp_path)
    library = directory / f"{directory.name}.so"
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    assert not build.intact(library)
    done = load_in(tmp_path, timeout=60, PATH="/nonexistent")
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "C++ CPU kernels unavailable" in done.stderr


def test_sigterm_while_the_model_loads_exits(tmp_path, tiny_dir):
    """A server stuck loading (here: waiting on another process's kernel build) exits on
    SIGTERM within seconds, with code 1, where it needed SIGKILL before."""
    directory = built_copy(tmp_path)
    (directory / f"{directory.name}.so.sha256").write_text("not this library")
    (directory / "lock").touch()  # and torch's, as a killed build leaves it
    port = free_port()
    with open(directory / "ridgeline.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", str(tiny_dir), "--port",
             str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # up, and loading
                assert proc.poll() is None, proc.stdout.read()
                try:
                    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    if health.json().get("reason") == "loading":
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, out
    assert "stopping while the model loads" in out


def serve_default_model(cache: str, timeout: float, limit_file_bytes: int | None = None
                        ) -> subprocess.CompletedProcess:
    """`ridgeline serve` on the embedded GGUF, its conversion cached in `cache`, with
    files written capped at `limit_file_bytes` (RLIMIT_FSIZE: a full disk as a write sees
    it; Python ignores the signal, so the write fails with EFBIG)."""
    def limit() -> None:
        if limit_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port())], cwd=ROOT,
        capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
        env={**os.environ, "RIDGELINE_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("fault", ["not permitted", "full"])
def test_a_model_cache_that_cannot_be_written_ends_the_start_with_a_clear_error(
        tmp_path, fault):
    """The embedded GGUF's conversion cannot be written: under /sys (EPERM for every
    user, root included) or with no room for a byte (EFBIG). The start exits 1 naming
    the directory and the setting that moves it, and leaves no temporary directory."""
    cache = "/sys/ridgeline-cache" if fault == "not permitted" else str(tmp_path / "cache")
    done = serve_default_model(cache, 120, limit_file_bytes=0 if fault == "full" else None)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot write the converted model into" in done.stderr
    assert "RIDGELINE_CACHE_DIR" in done.stderr and cache in done.stderr
    if fault == "full":
        assert not any(Path(cache).iterdir())  # the half-written conversion is gone


@pytest.mark.parametrize("cut", ["header", "weights"])
def test_a_truncated_gguf_ends_the_start_with_a_clear_error(tmp_path, cut):
    """The embedded GGUF cut short (a killed download): inside its header, or halfway
    through its weights. The start exits 1 naming the file, before any conversion."""
    from models.resolve import default_gguf_path

    data = default_gguf_path().read_bytes()
    cut_file = tmp_path / "cut.gguf"
    cut_file.write_bytes(data[:4096] if cut == "header" else data[:len(data) // 2])
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--model", str(cut_file), "--port",
         str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "RIDGELINE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"{cut_file} is not a readable GGUF file (truncated or corrupt?)" in done.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_two_first_starts_at_once_convert_the_model_once(tmp_path):
    """Two processes resolve the embedded GGUF into one empty cache at the same moment:
    both get the same complete directory; one conversion is kept, no temporary is left."""
    script = "from models.resolve import resolve_model; print(resolve_model())"
    env = {**os.environ, "RIDGELINE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(dirs) == 1 and [p.name for p in tmp_path.iterdir()] == [Path(*dirs).name]
    assert (Path(*dirs) / "config.json").is_file()
