"""Does a server's memory stay flat under repeated load? Waves of requests of varied
lengths against one `ridgeline serve`, its resident set read after each.

    python benchmarks/rss_soak.py [--waves 8] [--prompts 192] [--concurrency 48]
        [--launch "--max-num-seqs 64"] [--env KEY=VALUE ...] [OUT.json]

The script starts `ridgeline serve` (default flags, the embedded model, plus `--launch`)
on a free port with `--env` added to its environment, then runs `--waves` rounds of
`ridgeline bench serve`: `--prompts` requests each, prompts of 64-1024 tokens and
answers of 16-256 (`--random-range-ratio`, a new seed every wave), `--concurrency` at a
time. After start and after every wave it reads the server's VmRSS and VmHWM
(`/proc/PID/status`) and the KV blocks kept as prefix cache (`/metrics`: between waves
no block is in use, and the cached ones are the pool's touched pages).

Warm-up is the first waves: the KV pool's pages are touched as blocks are first used
(a finished request's blocks stay as prefix cache until the pool is full), and the
allocator's arenas grow to the step's largest activations. After it, a server that
does not leak holds its resident set: the report gives the growth per wave over the
last half of the waves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.replicas import free_port

ROOT = Path(__file__).resolve().parent.parent
CACHED = re.compile(r'^ridgeline:kv_blocks\{[^}]*state="cached"[^}]*\} (\S+)$', re.M)


def memory_mb(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def kv_cached(url: str) -> float | None:
    found = CACHED.findall(httpx.get(url + "/metrics", timeout=30).text)
    return sum(map(float, found)) if found else None


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not ready")


def wave(url: str, args, seed: int, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "serve", "--base-url", url,
         "--num-prompts", str(args.prompts), "--input-len", "544", "--output-len", "136",
         "--random-range-ratio", "0.88", "--max-concurrency", str(args.concurrency),
         "--ignore-eos", "--no-plots", "--save-result", "--result-dir", str(out),
         "--result-filename", f"wave{seed}.json", "--seed", str(seed)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=3600)
    result = json.loads((out / f"wave{seed}.json").read_text())
    return {"completed": result.get("completed"), "duration_s": result.get("duration")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=None, help="write the figures as JSON here")
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--prompts", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--launch", default="", help="extra `ridgeline serve` flags")
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="added to the server's environment")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port),
           *shlex.split(args.launch)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_ready(url, proc)
        rows.append({"wave": 0, **memory_mb(proc.pid), "kv_cached": kv_cached(url)})
        with tempfile.TemporaryDirectory() as raw:
            for i in range(1, args.waves + 1):
                done = wave(url, args, i, Path(raw))
                rows.append({"wave": i, **memory_mb(proc.pid), "kv_cached": kv_cached(url),
                             **done})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    late = rows[len(rows) // 2:]
    growth = (late[-1]["VmRSS"] - late[0]["VmRSS"]) / max(1, len(late) - 1)
    print("\n| wave | VmRSS (MB) | VmHWM (MB) | KV blocks cached |\n| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['wave']} | {r['VmRSS']:.0f} | {r['VmHWM']:.0f} | {r['kv_cached']} |")
    print(f"\ngrowth over the last {len(late)} readings: {growth:+.1f} MB a wave")
    if args.out:
        Path(args.out).write_text(json.dumps({"launch": args.launch, "env": args.env,
                                              "waves": rows, "late_growth_mb_per_wave":
                                              growth}, indent=1) + "\n")


if __name__ == "__main__":
    main()
