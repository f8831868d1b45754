"""One user, streamed: where the time between tokens goes, two servers side by side.

    python benchmarks/conc1_itl_ab.py [--a TREE] [--b TREE] [--a-flag auto|on|off]
        [--b-flag auto|on|off] [--prompts 12] [--input-len 128] [--output-len 128]
        [--offline-steps 100] [--model DIR] [--out FILE.json]

Two `ridgeline serve` processes on SmolLM2, each from a source tree (`--a`, `--b`; this
checkout by default) and each with `AsyncEngine.stream_before_submit` forced on or off
(`--a-flag`, `--b-flag`; `auto` keeps the engine's choice). One streamed
/v1/completions request at a time, random token ids, `ignore_eos`, alternated between the
servers (A B, then B A, ...), so both see the same phases of a noisy host: only the
ratios mean anything. Each server records, per step, when the model thread ran it, when
the loop processed and posted it, and when each SSE chunk was written; the client
records when each chunk arrived. Printed per server (and saved as JSON with the host's
CPU and ISA):

- TPOT (per request, median) and the inter-token latencies' p50/p90/p99, as
  `ridgeline bench serve` computes them;
- the model thread's step (`forward`: stage, forward, logits, sampling), the host gap
  from one step's end to the next one's start (the loop's processing, scheduling,
  streaming, the hand-over to the model thread), and the step cadence;
- how late the SSE write is after its step ended (`end->write`), the event-loop
  thread's CPU time per step.

Before the servers, `--offline-steps` decode steps of one request in an offline engine
(`LLM`) from each tree, timed one by one: the same step without HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE_PORT = 8211


# -- the server side: `--serve` runs inside each server process --------------------------

def serve(tree: str, flag: str, probe: str, argv: list[str]) -> int:
    """`ridgeline serve` with per-step timestamps, written to `probe` at exit."""
    import atexit

    import sse_starlette.sse as sse

    from app.engine import async_engine, core
    from gpu import runner

    clock = time.perf_counter
    rec: dict[str, list[float]] = {k: [] for k in ("exec0", "exec1", "process", "submit",
                                                   "write", "loop_cpu")}

    def timed(cls, name, before=None, after=None):
        fn = getattr(cls, name)

        def wrapper(self, *a, **k):
            if before:
                rec[before].append(clock())
            out = fn(self, *a, **k)
            if after:
                rec[after].append(clock())
            return out
        setattr(cls, name, wrapper)

    timed(runner.ModelRunner, "execute", "exec0", "exec1")
    timed(core.EngineCore, "submit", "submit")
    process = core.EngineCore.process

    def processing(self, *a):
        rec["process"].append(clock())
        rec["loop_cpu"].append(time.thread_time())
        return process(self, *a)
    core.EngineCore.process = processing
    send = sse.EventSourceResponse._send_with_timeout

    async def sending(self, *a):
        await send(self, *a)
        rec["write"].append(clock())
    sse.EventSourceResponse._send_with_timeout = sending
    init = async_engine.AsyncEngine.__init__

    def initialise(self, *a, **k):
        init(self, *a, **k)
        if flag != "auto":
            self.stream_before_submit = flag == "on"
    async_engine.AsyncEngine.__init__ = initialise
    atexit.register(lambda: Path(probe).write_text(json.dumps(rec)))
    from app.cli import main
    return main(argv)


def offline_steps(steps: int, input_len: int, model: str | None) -> list[float]:
    """Seconds of `steps` one-request decode steps of an offline engine."""
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    engine = LLM(model, dtype="auto").engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 12, temperature=0, ignore_eos=True)
    engine.add_request("r", [rng.randrange(100, 40000) for _ in range(input_len)], params)
    for _ in range(10):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.shutdown()
    return times


# -- the client ---------------------------------------------------------------------------

async def one_request(session, url: str, prompt: list[int], output_len: int) -> list[float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0}
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


async def drive(urls: list[str], prompts: int, input_len: int, output_len: int):
    import aiohttp

    rng = random.Random(0)
    got: dict[str, list[list[float]]] = {u: [] for u in urls}
    # A fresh connection per request: a server closes one idle past its keep-alive.
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for i in range(prompts + 1):  # the first round warms both servers up
            prompt = [rng.randrange(100, 40000) for _ in range(input_len)]
            for url in (urls if i % 2 == 0 else urls[::-1]):
                times = await one_request(session, url, prompt, output_len)
                if i:
                    got[url].append(times)
    return got


def pct(values, ps=(50, 90, 99)) -> dict[str, float]:
    a = np.asarray(values, dtype=float) * 1e3
    return {f"p{p}": round(float(np.percentile(a, p)), 3) for p in ps} if a.size else {}


def summarise(requests: list[list[float]], probe: dict[str, list[float]]) -> dict:
    itl = [b - a for t in requests for a, b in zip(t[1:], t[2:])]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in requests if len(t) > 1]
    e0, e1 = np.array(probe["exec0"]), np.array(probe["exec1"])
    spans = [(t[1], t[-1]) for t in requests if len(t) > 2]
    inside = np.array([any(a <= x <= b for a, b in spans) for x in e0])
    write = np.array(probe["write"])
    j = np.searchsorted(e1, write) - 1
    return {
        "tpot_median_ms": round(1e3 * statistics.median(tpot), 3),
        "itl_ms": pct(itl),
        "forward_ms": pct((e1 - e0)[inside]),
        "gap_ms": pct((e0[1:] - e1[:-1])[inside[1:]]),
        "cadence_ms": pct(np.diff(e0)[inside[:-1]]),
        "end_to_write_ms": pct((write - e1[j])[j >= 0]),
        "loop_cpu_per_step_ms": pct(np.diff(probe["loop_cpu"])),
        "tokens": len(itl),
    }


def start_server(tree: str, flag: str, port: int, probe: Path, model: str, log: Path):
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, str(HERE / "conc1_itl_ab.py"), "--serve", tree, flag, str(probe),
           "serve", *(["--model", model] if model else []), "--served-model-name", "m",
           "--port", str(port)]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def wait_healthy(url: str, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", default=str(ROOT))
    ap.add_argument("--b", default=str(ROOT))
    ap.add_argument("--a-flag", default="off", choices=("auto", "on", "off"))
    ap.add_argument("--b-flag", default="on", choices=("auto", "on", "off"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--offline-steps", type=int, default=100)
    ap.add_argument("--model", default=None, help="a model directory (default: Ridgeline's "
                    "default model, SmolLM2)")
    ap.add_argument("--out", default="bench_results/conc1_itl_ab.json")
    a = ap.parse_args()
    from host import describe

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    servers = {"A": (a.a, a.a_flag), "B": (a.b, a.b_flag)}
    result: dict = {"host": describe(), "args": vars(a), "servers": {}}
    for name, (tree, _) in servers.items():
        if a.offline_steps:
            code = (f"import sys, json; sys.path[:0] = [{tree!r}, {str(HERE)!r}]; "
                    f"from conc1_itl_ab import offline_steps; "
                    f"print(json.dumps(offline_steps({a.offline_steps}, {a.input_len}, "
                    f"{a.model!r})))")
            env = dict(os.environ, PYTHONPATH=tree)
            run = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env,
                                 capture_output=True, text=True, check=True)
            steps = json.loads(run.stdout.strip().splitlines()[-1])
            result["servers"].setdefault(name, {})["offline_step_ms"] = pct(steps)
    procs, urls = [], []
    try:
        for i, (name, (tree, flag)) in enumerate(servers.items()):
            port = BASE_PORT + i
            procs.append(start_server(tree, flag, port, out.with_suffix(f".{name}.probe"),
                                      a.model, out.with_suffix(f".{name}.log")))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_healthy(url)
        got = asyncio.run(drive(urls, a.prompts, a.input_len, a.output_len))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    for (name, (tree, flag)), url in zip(servers.items(), urls):
        probe = json.loads(out.with_suffix(f".{name}.probe").read_text())
        entry = result["servers"].setdefault(name, {})
        entry |= {"tree": tree, "stream_before_submit": flag} | summarise(got[url], probe)
    out.write_text(json.dumps(result, indent=1))
    print(f"host: {result['host']['cpu']} ({result['host']['cpus']} CPUs; "
          f"{result['host']['isa']})")
    cols = ("tpot", "itl p50", "itl p90", "itl p99", "offline", "forward", "gap",
            "end->write p50", "p90", "p99", "loop cpu")
    print("server " + " ".join(f"{c:>9s}" for c in cols) + "  (ms, medians unless pNN)")
    for name, e in result["servers"].items():
        row = (e["tpot_median_ms"], e["itl_ms"]["p50"], e["itl_ms"]["p90"], e["itl_ms"]["p99"],
               e.get("offline_step_ms", {}).get("p50", float("nan")), e["forward_ms"]["p50"],
               e["gap_ms"]["p50"], e["end_to_write_ms"]["p50"], e["end_to_write_ms"]["p90"],
               e["end_to_write_ms"]["p99"], e["loop_cpu_per_step_ms"]["p50"])
        print(f"{name} {e['stream_before_submit']:>4s} " + " ".join(f"{v:9.2f}" for v in row))
    print(f"saved {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        tree, flag, probe = sys.argv[2:5]
        sys.path.insert(0, tree)
        sys.exit(serve(tree, flag, probe, sys.argv[5:]))
    main()
