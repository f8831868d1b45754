"""`ridgeline bench serve`: online latency and throughput against any OpenAI-compatible server.

The metrics keep vLLM's `benchmark_serving` definitions so that numbers from
either tool compare: TTFT is send to first text; TPOT = (E2E − TTFT) / (output
tokens − 1) per request; ITL is every gap between text events, pooled across
requests; E2E runs from send to the last text event. Output tokens come from the
usage event the client asks for (`stream_options.include_usage`). Goodput counts
requests that meet every SLO given (`--goodput ttft:ms tpot:ms e2el:ms`; a
request with one output token has a TPOT of 0, as in vLLM).

Arrivals are a gamma process at `--request-rate` (shape `--burstiness`; 1 is
Poisson, below 1 burstier), optionally capped by `--max-concurrency`. Requests
are never retried: a rejected or broken request counts as a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from app.client import AsyncClient, ClientError

WORDS = ("the of and to in is was for on that with as by at from his it an were are which "
         "this be or has had first one their its new after who they have her she two been "
         "other when there all time during into school year more city some world people "
         "state most house game under water music river light story road family market "
         "number season night paper group order early power point small young").split()
TOKENS_PER_WORD = 1.3  # English text, when the server cannot /tokenize
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int
    output_len: int


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


# -- workloads ------------------------------------------------------------------------------


class TokenCounter:
    """Token counts from the server's /tokenize; words × 1.3 where it has none."""

    def __init__(self, client: AsyncClient, model: str | None):
        self.client, self.model, self.exact = client, model, True

    async def __call__(self, text: str) -> int:
        if self.exact:
            try:
                return len(await self.client.tokenize(text, model=self.model))
            except ClientError as e:
                self.exact = False
                print(f"no /tokenize ({e}); approximating tokens as words x {TOKENS_PER_WORD}")
        return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def random_requests(n: int, input_len: int, output_len: int, ratio: float, seed: int,
                          count: TokenCounter) -> list[RequestSpec]:
    """Prompts of random common words, sized by one calibration of tokens per word."""
    rng = random.Random(seed)
    sample = " ".join(rng.choice(WORDS) for _ in range(256))
    per_word = await count(sample) / 256
    specs = []
    for i, (n_in, n_out) in enumerate(zip(_lengths(n, input_len, ratio, rng),
                                          _lengths(n, output_len, ratio, rng))):
        words = max(1, round(n_in / per_word) - 1)
        prompt = f"{i} " + " ".join(rng.choice(WORDS) for _ in range(words))
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


async def sharegpt_requests(path: str, n: int, seed: int, count: TokenCounter,
                            output_len: int | None) -> list[RequestSpec]:
    """First human turn → prompt; the reply's length → output length (vLLM's filters)."""
    data = [d["conversations"] for d in json.loads(Path(path).read_text())
            if len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(data)
    specs: list[RequestSpec] = []
    for conv in data:
        if len(specs) == n:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in = await count(prompt)
        n_out = output_len or await count(reply)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        specs.append(RequestSpec(prompt, n_in, n_out))
    if len(specs) < n:
        print(f"warning: {path} gave {len(specs)} usable conversations, not {n}")
    return specs


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between arrivals: gamma with mean 1/rate (Poisson at burstiness 1)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# -- metrics --------------------------------------------------------------------------------


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


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: list[RequestResult], duration: float,
                    slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    tpots = [tpot(r) for r in ok if r.output_tokens > 1]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if all(
        {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}[k] <= ms / 1000
        for k, ms in slos.items()))
    return {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        **_stats("ttft", [r.ttft for r in ok]), **_stats("tpot", tpots),
        **_stats("itl", [g for r in ok for g in r.itl]), **_stats("e2el", [r.latency for r in ok]),
    }


# -- the run --------------------------------------------------------------------------------


async def send(client: AsyncClient, a: argparse.Namespace, spec: RequestSpec,
               t0: float) -> RequestResult:
    extra: dict = {"temperature": a.temperature}
    if a.ignore_eos:
        extra["ignore_eos"] = True  # a vLLM/SGLang extension: plain OpenAI would refuse it
    r = RequestResult(prompt_len=spec.prompt_len)
    st = time.perf_counter()
    r.start = st - t0
    last, chunks = st, 0
    try:
        if a.endpoint.endswith("chat/completions"):
            stream = await client.chat([{"role": "user", "content": spec.prompt}],
                                       model=a.model, max_tokens=spec.output_len, stream=True,
                                       **extra)
        else:
            stream = await client.completions(spec.prompt, model=a.model,
                                              max_tokens=spec.output_len, stream=True, **extra)
        async for d in stream:
            now = time.perf_counter()
            if d.text:
                if chunks == 0:
                    r.ttft = now - st
                else:
                    r.itl.append(now - last)
                last, chunks = now, chunks + 1
                r.text_times.append(now - t0)
            if d.usage is not None:
                r.output_tokens, r.prompt_len = d.usage.completion_tokens, d.usage.prompt_tokens
        r.output_tokens = r.output_tokens or chunks
        r.latency, r.success = last - st, chunks > 0
        r.error = "" if r.success else "no text received"
    except ClientError as e:
        r.error = str(e)
    return r


async def sample_running(client: AsyncClient, t0: float, interval: float,
                         in_flight: list[int], out: dict[str, list]) -> None:
    """Every `interval` s: the server's running requests (where /metrics has them) and ours."""
    pattern = re.compile(r"^(?:ridgeline|vllm):num_requests_running(?:\{[^}]*\})? (\S+)$", re.M)
    while True:
        text = await client.metrics()
        values = [float(v) for v in pattern.findall(text)]
        out["t"].append(time.perf_counter() - t0)
        out["running_server"].append(sum(values) if values else None)
        out["in_flight_client"].append(in_flight[0])
        await asyncio.sleep(interval)


async def benchmark(a: argparse.Namespace) -> dict | None:
    from tqdm import tqdm

    async with AsyncClient(a.base_url, a.api_key, max_retries=0) as client:
        if a.model is None:
            try:
                a.model = (await client.models())[0]["id"]
            except (ClientError, IndexError, KeyError) as e:
                print(f"cannot list the server's models ({e}); pass --model")
                return None
        count = TokenCounter(client, a.model)
        if a.dataset_path:
            specs = await sharegpt_requests(a.dataset_path, a.num_prompts, a.seed, count,
                                            a.sharegpt_output_len)
        else:
            specs = await random_requests(a.num_prompts, a.input_len, a.output_len,
                                          a.random_range_ratio, a.seed, count)
        if not specs:
            print("no requests to send")
            return None
        warm = await send(client, a, RequestSpec(specs[0].prompt, 0, min(4, a.output_len)),
                          time.perf_counter())
        if not warm.success:
            print(f"the test request failed: {warm.error}")
            return None
        gate = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        in_flight, timeline = [0], {"t": [], "running_server": [], "in_flight_client": []}
        bar = tqdm(total=len(specs), disable=a.disable_tqdm, desc="requests")

        async def one(spec: RequestSpec) -> RequestResult:
            if gate is not None:
                await gate.acquire()
            in_flight[0] += 1
            try:
                return await send(client, a, spec, t0)
            finally:
                in_flight[0] -= 1
                bar.update(1)
                if gate is not None:
                    gate.release()

        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_running(client, t0, a.metrics_interval, in_flight,
                                                     timeline))
        tasks = []
        for spec, gap in zip(specs, arrival_gaps(len(specs), a.request_rate, a.burstiness,
                                                 a.seed)):
            tasks.append(asyncio.create_task(one(spec)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        sampler.cancel()
        bar.close()
    metrics = compute_metrics(results, duration, parse_goodput(a.goodput))
    return {"metrics": metrics, "results": results, "timeline": timeline}


def print_table(m: dict, slos: dict[str, float]) -> None:
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration"]),
            ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"])]
    if slos:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    rows += [("Output token throughput (tok/s)", m["output_throughput"]),
             ("Total token throughput (tok/s)", m["total_token_throughput"])]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", None))
        rows += [(f"{s.capitalize()} {key.upper()} (ms)", m[f"{s}_{key}_ms"])
                 for s in ("mean", "median", "p99")]
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


def run(a: argparse.Namespace) -> int:
    try:
        slos = parse_goodput(a.goodput)  # fail on a bad flag before any traffic
    except ValueError as e:
        print(e)
        return 2
    out = asyncio.run(benchmark(a))
    if out is None:
        return 1
    m = out["metrics"]
    print_table(m, slos)
    results = out["results"]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": a.base_url, "endpoint": a.endpoint, "model": a.model,
        "dataset": a.dataset_path or "random", "num_prompts": len(results),
        "request_rate": a.request_rate if a.request_rate != float("inf") else "inf",
        "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
        "ignore_eos": a.ignore_eos, "goodput_slos_ms": slos, **m,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results], "errors": [r.error for r in results],
        "timeline": out["timeline"],
    }
    result_dir = Path(a.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / a.result_filename
    stem = path.with_suffix("")
    result["plots"] = [] if a.no_plots else plot(out, stem)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}" + "".join(f", {p}" for p in result["plots"]))
    return 0 if m["completed"] else 1


__all__ = ["RequestResult", "RequestSpec", "arrival_gaps", "compute_metrics", "parse_goodput",
           "run", "tpot"]
