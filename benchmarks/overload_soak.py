"""Goodput under overload: Poisson arrivals at capacity and at a multiple of it, every
client sending its deadline (`X-Request-Timeout`).

    python benchmarks/overload_soak.py --duration 300 --timeout 60 [--capacity R]
        [--launch "--model M --max-model-len 1024"] [--base-url URL] [OUT.json]

With `--launch`, the script starts `ridgeline serve` with those flags (default flags
otherwise) on a free port and stops it at the end; without it, it drives the server at
`--base-url`. Capacity, unless given, is the completed requests per second of a
closed-loop run at `--calibrate-concurrency` clients for `--calibrate-s` seconds. Then
one `ridgeline bench serve` run per load factor (`--loads 1 2`), `--duration` seconds
of Poisson arrivals each, with `--request-timeout` = `--timeout`.

Per load it reports: goodput (requests answered within their deadline per second: the
client leaves at its deadline, so a completed request met it), what was refused at
arrival (503 `deadline` or `queue_full`, from the server's counters), shed from the
queue (503 `shed`), timed out at the client, and the prefill the server spent on
requests that got no answer (`ridgeline:wasted_prefill_tokens_total`). Requests are
not streamed by default (`--stream-fraction 0`): the client's timeout then bounds the
whole answer, which is what the server can check at arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.bench import serve_args
from app.bench.serve import benchmark

REJECTIONS = re.compile(r'^ridgeline:admission_rejections_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$',
                        re.M)
WASTED = re.compile(r"^ridgeline:wasted_prefill_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)


def counters(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {f"rejected_{reason}": float(v) for reason, v in REJECTIONS.findall(text)}
    out["wasted_prefill_tokens"] = sum(float(v) for v in WASTED.findall(text))
    return out


def bench_args(a: argparse.Namespace, extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_args.add_arguments(p)
    b = p.parse_args(["--base-url", a.base_url, "--random-input-len", str(a.input_len),
                      "--random-output-len", str(a.output_len), "--random-range-ratio", "0.5",
                      "--ignore-eos", "--disable-tqdm", "--no-plots", "--metrics-interval", "2",
                      *extra])
    b.percentiles = (50.0, 99.0)
    return b


def calibrate(a: argparse.Namespace) -> float:
    n = max(4, int(a.calibrate_s * 4))
    b = bench_args(a, ["--num-prompts", str(n), "--max-concurrency",
                       str(a.calibrate_concurrency), "--stream-fraction", "0"])

    async def timed() -> dict:
        return await asyncio.wait_for(benchmark(b), a.calibrate_s * 3 + 60)
    try:
        out = asyncio.run(timed())
    except TimeoutError:
        sys.exit("calibration did not finish: pass --capacity")
    return out["metrics"]["request_throughput"]


def soak(a: argparse.Namespace, rate: float) -> dict:
    n = max(1, round(rate * a.duration))
    b = bench_args(a, ["--num-prompts", str(n), "--request-rate", f"{rate:.4f}",
                       "--request-timeout", str(a.timeout),
                       "--stream-fraction", str(a.stream_fraction), "--seed", str(a.seed)])
    before = counters(a.base_url)
    out = asyncio.run(benchmark(b))
    time.sleep(2.0)  # the last aborts and sheds reach the counters
    after = counters(a.base_url)
    m = out["metrics"]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "rate": rate, "sent": n, "duration_s": m["duration"], "completed": m["completed"],
        "goodput_rps": m["completed"] / m["duration"],
        "refused_503": m["refused"],
        "refused_at_arrival": delta.get("rejected_deadline", 0) + delta.get(
            "rejected_queue_full", 0),
        "shed_from_queue": delta.get("rejected_shed", 0),
        "client_timeouts": m["timeout"], "failed": m["failed"] - m["refused"] - m["timeout"],
        "wasted_prefill_tokens": delta.get("wasted_prefill_tokens", 0),
        "median_e2el_ms": m["median_e2el_ms"], "p99_e2el_ms": m["p99_e2el_ms"],
    }


def launch(a: argparse.Namespace) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a.base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port),
           "--log-stats-interval", "0", *shlex.split(a.launch)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}): {shlex.join(cmd)}")
        try:
            if httpx.get(a.base_url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not become healthy within 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="bench_results/overload_soak.json")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", default=None, help="start `ridgeline serve` with these flags")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per load")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="each client's deadline in seconds (sent as X-Request-Timeout)")
    p.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0],
                   help="arrival rates as multiples of capacity")
    p.add_argument("--capacity", type=float, default=None, help="requests/s (default: measure)")
    p.add_argument("--calibrate-s", type=float, default=30.0)
    p.add_argument("--calibrate-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--stream-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    proc = launch(a) if a.launch is not None else None
    try:
        capacity = a.capacity or calibrate(a)
        print(f"capacity: {capacity:.3f} requests/s")
        runs = []
        for load in a.loads:
            r = soak(a, capacity * load)
            r["load"] = load
            runs.append(r)
            print(json.dumps(r))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    base = next((r["goodput_rps"] for r in runs if r["load"] == 1.0), None)
    for r in runs:
        r["goodput_vs_capacity"] = r["goodput_rps"] / base if base else None
    print(f"{'load':>5} {'sent':>5} {'ok':>5} {'goodput/s':>9} {'vs 1x':>6} {'arrival':>7} "
          f"{'shed':>5} {'timeout':>7} {'wasted prefill':>14}")
    for r in runs:
        vs = f"{r['goodput_vs_capacity']:.2f}" if r["goodput_vs_capacity"] else "-"
        print(f"{r['load']:>5.1f} {r['sent']:>5} {r['completed']:>5} {r['goodput_rps']:>9.3f} "
              f"{vs:>6} {r['refused_at_arrival']:>7.0f} {r['shed_from_queue']:>5.0f} "
              f"{r['client_timeouts']:>7} {r['wasted_prefill_tokens']:>14.0f}")
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"capacity_rps": capacity, "timeout_s": a.timeout,
                                "duration_s": a.duration, "runs": runs}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
