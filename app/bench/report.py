"""What `ridgeline bench serve` reports, with vLLM's `benchmark_serving` definitions.

TTFT is send to first text; TPOT = (E2E − TTFT) / (output tokens − 1) per request;
ITL is every gap between text events, pooled across requests; E2E runs from send to
the last text event. Goodput counts requests that meet every SLO given
(`--goodput ttft:ms tpot:ms e2el:ms`; a request with one output token has a TPOT of
0, as in vLLM). Requests that did not succeed are told apart: refused with a 503
before any byte, timed out by the client, disconnected on purpose, failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds after the benchmark started
    text_times: list[float] = field(default_factory=list)  # ditto, one per text event
    error: str = ""
    # How it ended when it did not succeed: "refused" (an HTTP 503 before any byte),
    # "timeout" (the client gave up), "disconnected" (left on purpose), "failed".
    outcome: str = ""
    streamed: bool = True  # False: the whole answer came at once (TTFT = E2E)
    generated_text: str = ""


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO (milliseconds). A request that did not stream has
    no first token of its own: it meets TTFT and TPOT when its whole answer came within
    the budget they add up to (TTFT + TPOT × (tokens − 1))."""
    if not r.streamed:
        budget = slos.get("ttft", 0.0) + slos.get("tpot", 0.0) * max(0, r.output_tokens - 1)
        limits = [budget] if ("ttft" in slos or "tpot" in slos) else []
        limits += [slos["e2el"]] if "e2el" in slos else []
        return all(r.latency <= ms / 1000 for ms in limits)
    return all({"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}[k] <= ms / 1000
               for k, ms in slos.items())


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_NAMES or not re.fullmatch(r"\d+(\.\d*)?", value):
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME in {SLO_NAMES}")
        slos[name] = float(value)
    return slos


def tpot(r: RequestResult) -> float:
    """Time per output token after the first; 0 when there is at most one token."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def _stats(name: str, seconds: list[float],
           percentiles: tuple[float, ...] = (99,)) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(results: list[RequestResult], duration: float,
                    slos: dict[str, float], percentiles: tuple[float, ...] = (99,)) -> dict:
    ok = [r for r in results if r.success]
    outcomes = {k: sum(1 for r in results if r.outcome == k)
                for k in ("refused", "timeout", "disconnected")}
    streamed = [r for r in ok if r.streamed]  # TTFT, TPOT and ITL exist for these only
    tpots = [tpot(r) for r in streamed if r.output_tokens > 1]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if meets(r, slos))
    return {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        **outcomes, "refused_share": outcomes["refused"] / max(1, len(results)),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        **_stats("ttft", [r.ttft for r in streamed], percentiles),
        **_stats("tpot", tpots, percentiles),
        **_stats("itl", [g for r in streamed for g in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
    }


def print_table(m: dict, slos: dict[str, float], metrics: tuple[str, ...] = METRIC_NAMES,
                percentiles: tuple[float, ...] = (99,)) -> None:
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"])]
    rows += [(f"  of which {label}", m[key]) for key, label in (
        ("refused", "refused (503)"), ("timeout", "timed out"),
        ("disconnected", "disconnected on purpose")) if m[key]]
    if m.get("wasted_prefill_tokens") is not None:
        rows.append(("Prefill tokens with no answer", m["wasted_prefill_tokens"]))
    rows += [("Benchmark duration (s)", m["duration"]),
            ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"])]
    if slos:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    rows += [("Output token throughput (tok/s)", m["output_throughput"]),
             ("Total token throughput (tok/s)", m["total_token_throughput"])]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in metrics:
        rows.append((f"-- {titles[key]} --", None))
        rows += [(f"{s.capitalize()} {key.upper()} (ms)", m[f"{s}_{key}_ms"])
                 for s in ("mean", "median")]
        rows += [(f"P{p:g} {key.upper()} (ms)", m[f"p{p:g}_{key}_ms"]) for p in percentiles]
    print("{s:=^60}".format(s=" Serving Benchmark Result "))
    for name, value in rows:
        if value is None:
            print(f"{name:-^60}")
        else:
            print(f"{name + ':':<44}{value:>16.2f}" if isinstance(value, float)
                  else f"{name + ':':<44}{value:>16}")
    print("=" * 60)


def plot(out: dict, stem: Path) -> list[str]:
    """Latency CDFs, and tokens/s and running requests over time; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no plots (pip install matplotlib)")
        return []
    ok = [r for r in out["results"] if r.success]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, [
            ("TTFT", [r.ttft for r in ok]), ("TPOT", [tpot(r) for r in ok if r.output_tokens > 1]),
            ("ITL", [g for r in ok for g in r.itl]), ("E2E latency", [r.latency for r in ok])]):
        ms = np.sort(np.asarray(values)) * 1000
        ax.plot(ms, np.arange(1, len(ms) + 1) / max(1, len(ms)))
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [str(stem) + "_latency_cdf.png"]
    fig.savefig(paths[0], dpi=100)
    fig2, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    duration = out["metrics"]["duration"]
    edges = np.linspace(0, duration, max(2, min(100, int(duration / 0.25) + 1)))
    times = [t for r in ok for t in r.text_times]
    weights = [r.output_tokens / len(r.text_times) for r in ok for _ in r.text_times]
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    top.step(edges[:-1], counts / np.diff(edges), where="post")
    top.set(ylabel="output tokens/s", title="Throughput and running requests over time")
    tl = out["timeline"]
    if any(v is not None for v in tl["running_server"]):
        bottom.plot(tl["t"], [np.nan if v is None else v for v in tl["running_server"]],
                    label="server: num_requests_running")
    bottom.plot(tl["t"], tl["in_flight_client"], label="client: requests in flight", alpha=0.7)
    bottom.set(xlabel="seconds", ylabel="requests")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig2.tight_layout()
    paths.append(str(stem) + "_timeline.png")
    fig2.savefig(paths[1], dpi=100)
    plt.close("all")
    return paths
