"""`ridgeline bench serve`: online latency, throughput and goodput against any
OpenAI-compatible server (Ridgeline, vLLM, SGLang, ...).

A vLLM user's command line works: the flags keep `vllm bench serve`'s names
(`--random-input-len`, `--random-prefix-len`, `--dataset-name`, `--host`/`--port`,
`--served-model-name`, `--percentile-metrics`, ...), and the metrics keep its
definitions (`report.py`). Arrivals are a gamma process at `--request-rate` (shape
`--burstiness`; 1 is Poisson), optionally capped by `--max-concurrency`. Requests are
never retried: a refused or broken request counts as such.

For overload soaks, Ridgeline's own flags mix in what real traffic does:
`--stream-fraction` (some clients do not stream), `--disconnect-fraction` (some leave
early), `--request-timeout` (clients give up, and say so in `X-Request-Timeout`).
The run then also reports the prefill the server spent on requests that got no
answer (its prompt-token counter, less the prompts of completed requests).

vLLM's other flags keep its meaning: `--num-warmups`, `--ready-check-timeout-sec`,
`--ramp-up-strategy`, `--header`, `--extra-body`, `--request-id-prefix` (sent as
`x-request-id`), `--logprobs`, `--profile` (vLLM's `/start_profile`, where a server
has it), `--label`, `--metadata`, `--save-detailed`, `--append-result`
(`result_file.py`). Each request's stream is opened with `async with`: a request the
client leaves (a timeout, `--disconnect-fraction`) closes its connection at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone

from app.bench.progress import Progress
from app.bench.report import (
    METRIC_NAMES,
    RequestResult,
    compute_metrics,
    parse_goodput,
    plot,
    print_table,
)
from app.bench.result_file import key_values, result_path, write_result
from app.bench.workload import (
    RequestSpec,
    TokenCounter,
    arrival_gaps,
    check_ramp,
    load_tokenizer,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from app.client import APIStatusError, AsyncClient, ClientError

PROMPT_TOKENS = re.compile(r"^(?:ridgeline|vllm):prompt_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)


async def send(client: AsyncClient, a: argparse.Namespace, spec: RequestSpec, t0: float,
               stream: bool = True, leave_after: float | None = None,
               request_id: str | None = None) -> RequestResult:
    """One request; the client leaves after `leave_after` seconds if that is set."""
    r = RequestResult(prompt_len=spec.prompt_len, streamed=stream)
    st = time.perf_counter()
    r.start = st - t0
    headers = dict(a.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id  # vLLM's benchmark: the id wins over --header
    try:
        async with asyncio.timeout(leave_after if leave_after is not None else a.request_timeout):
            await _exchange(client, a, spec, stream, r, st, t0, headers)
    except TimeoutError:
        r.success = False
        r.outcome, r.error = (("disconnected", "left on purpose") if leave_after is not None
                              else ("timeout", f"no answer within {a.request_timeout} s"))
    except APIStatusError as e:
        r.outcome, r.error = ("refused" if e.status == 503 else "failed"), str(e)
    except ClientError as e:
        r.outcome, r.error = "failed", str(e)
    return r


async def _exchange(client: AsyncClient, a: argparse.Namespace, spec: RequestSpec,
                    stream: bool, r: RequestResult, st: float, t0: float,
                    headers: dict[str, str]) -> None:
    extra: dict = {"temperature": a.temperature}
    for name in ("top_p", "top_k", "min_p"):
        if getattr(a, name) is not None:
            extra[name] = getattr(a, name)
    if a.ignore_eos:
        extra["ignore_eos"] = True  # a vLLM/SGLang extension: plain OpenAI would refuse it
    chat = a.endpoint.endswith("chat/completions")
    if not chat and a.logprobs is not None:
        extra["logprobs"] = a.logprobs
    extra |= a.extra_body or {}
    model = spec.model or a.model  # an adapter's name under --lora-modules
    if chat:
        call = client.chat([{"role": "user", "content": spec.prompt}], model=model,
                           max_tokens=spec.output_len, stream=stream, headers=headers, **extra)
    else:
        call = client.completions(spec.prompt, model=model, max_tokens=spec.output_len,
                                  stream=stream, headers=headers, **extra)
    if not stream:
        done = await call
        r.latency = r.ttft = time.perf_counter() - st
        if done.usage is not None:
            r.output_tokens, r.prompt_len = done.usage.completion_tokens, done.usage.prompt_tokens
        r.success, r.generated_text = bool(done.text), done.text
        r.outcome, r.error = ("", "") if r.success else ("failed", "no text received")
        return
    last, chunks, texts = st, 0, []
    async with call as deltas:
        async for d in deltas:
            now = time.perf_counter()
            if d.text:
                if chunks == 0:
                    r.ttft = now - st
                else:
                    r.itl.append(now - last)
                last, chunks = now, chunks + 1
                r.text_times.append(now - t0)
                texts.append(d.text)
            if d.usage is not None:
                r.output_tokens = d.usage.completion_tokens
                r.prompt_len = d.usage.prompt_tokens
    r.generated_text = "".join(texts)
    r.output_tokens = r.output_tokens or chunks
    r.latency, r.success = last - st, chunks > 0
    r.outcome, r.error = ("", "") if r.success else ("failed", "no text received")


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


async def _prompt_tokens(client: AsyncClient) -> float | None:
    try:
        values = PROMPT_TOKENS.findall(await client.metrics())
    except ClientError:
        return None
    return sum(map(float, values)) if values else None


async def ready(client: AsyncClient, a: argparse.Namespace, test: RequestSpec
                ) -> RequestResult:
    """The test request; retried for `--ready-check-timeout-sec` while it fails, as vLLM's
    ready check waits for a server still loading."""
    deadline = time.monotonic() + a.ready_check_timeout_sec
    while True:
        r = await send(client, a, test, time.perf_counter())
        if r.success or time.monotonic() >= deadline:
            return r
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def warm_up(client: AsyncClient, a: argparse.Namespace, test: RequestSpec,
                  gate: asyncio.Semaphore | None) -> None:
    """vLLM's `--num-warmups`: the test request that many times, not measured."""
    async def one() -> RequestResult:
        async with gate or contextlib.nullcontext():
            return await send(client, a, test, time.perf_counter())

    results = await asyncio.gather(*(one() for _ in range(a.num_warmups)))
    print(f"warm-up: {sum(r.success for r in results)} of {a.num_warmups} requests succeeded")


async def _profiler(client: AsyncClient, path: str) -> None:
    try:
        await client.post_json(path, {})
        print(f"{path}: done")
    except ClientError as e:
        print(f"{path}: the server refused ({e}); no profile")


async def benchmark(a: argparse.Namespace) -> dict | None:
    timeout = a.request_timeout or 600.0
    async with AsyncClient(a.base_url, a.api_key, timeout=timeout, max_retries=0) as client:
        if a.model is None:
            try:
                a.model = (await client.models())[0]["id"]
            except (ClientError, IndexError, KeyError) as e:
                print(f"cannot list the server's models ({e}); pass --model")
                return None
        count = TokenCounter(client, a.model,
                             load_tokenizer(a.tokenizer, a.trust_remote_code))
        if a.dataset_name == "sharegpt":
            if not a.dataset_path:
                print("--dataset-name sharegpt needs --dataset-path")
                return None
            specs = await sharegpt_requests(a.dataset_path, a.num_prompts, a.seed, count,
                                            a.sharegpt_output_len)
        elif a.dataset_name == "prefix_repetition":
            specs = await prefix_repetition_requests(
                a.num_prompts, a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len,
                a.prefix_repetition_num_prefixes, a.prefix_repetition_output_len, a.seed, count)
        else:
            specs = await random_requests(a.num_prompts, a.input_len, a.output_len,
                                          a.random_range_ratio, a.seed, count,
                                          a.random_prefix_len)
        if not specs:
            print("no requests to send")
            return None
        if a.lora_modules:  # each request names an adapter at random (vLLM's benchmark)
            rng = random.Random(a.seed)
            specs = [replace(s, model=rng.choice(a.lora_modules)) for s in specs]
        test = RequestSpec(specs[0].prompt, 0, min(4, a.output_len))
        warm = await ready(client, a, test)
        if not warm.success:
            print(f"the test request failed: {warm.error}")
            return None
        gate = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        if a.num_warmups > 0:
            await warm_up(client, a, test, gate)
        if a.profile:
            await _profiler(client, "/start_profile")
        rng = random.Random(a.seed)
        plan = [(rng.random() < a.stream_fraction,
                 rng.uniform(0.2, 10.0) if rng.random() < a.disconnect_fraction else None)
                for _ in specs]
        in_flight, timeline = [0], {"t": [], "running_server": [], "in_flight_client": []}
        bar = Progress(len(specs), "requests", disable=a.disable_tqdm)

        async def one(i: int, spec: RequestSpec, stream: bool,
                      leave: float | None) -> RequestResult:
            if gate is not None:
                await gate.acquire()
            in_flight[0] += 1
            try:
                return await send(client, a, spec, t0, stream, leave,
                                  f"{a.request_id_prefix}{i}")
            finally:
                in_flight[0] -= 1
                bar.update(1)
                if gate is not None:
                    gate.release()

        prefill_before = await _prompt_tokens(client)
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_running(client, t0, a.metrics_interval, in_flight,
                                                     timeline))
        tasks = []
        gaps = arrival_gaps(len(specs), a.request_rate, a.burstiness, a.seed, a.ramp)
        for i, (spec, (stream, leave), gap) in enumerate(zip(specs, plan, gaps)):
            tasks.append(asyncio.create_task(one(i, spec, stream, leave)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        sampler.cancel()
        bar.close()
        if a.profile:
            await _profiler(client, "/stop_profile")
        await asyncio.sleep(1.0)  # let the server count what it computed for the last ones
        prefill_after = await _prompt_tokens(client)
    metrics = compute_metrics(results, duration, parse_goodput(a.goodput), a.percentiles)
    metrics["wasted_prefill_tokens"] = None
    if prefill_before is not None and prefill_after is not None:
        useful = sum(r.prompt_len for r in results if r.success)
        metrics["wasted_prefill_tokens"] = int(max(0.0, prefill_after - prefill_before - useful))
    return {"metrics": metrics, "results": results, "timeline": timeline}


def run(a: argparse.Namespace) -> int:
    try:
        slos = parse_goodput(a.goodput)  # fail on a bad flag before any traffic
        a.percentiles = tuple(float(p) for p in a.metric_percentiles.split(","))
        shown = tuple(m.strip() for m in a.percentile_metrics.split(","))
        if not set(shown) <= set(METRIC_NAMES):
            raise ValueError(f"--percentile-metrics: choose from {','.join(METRIC_NAMES)}")
        a.headers = key_values(a.header, "--header")
        metadata = key_values(a.metadata, "--metadata")
        a.ramp = check_ramp(a.ramp_up_strategy, a.ramp_up_start_rps, a.ramp_up_end_rps,
                            a.request_rate)
        if a.extra_body is not None and not isinstance(a.extra_body, dict):
            raise ValueError("--extra-body: expected a JSON object")
    except ValueError as e:
        print(e)
        return 2
    if a.request_id_prefix is None:
        a.request_id_prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    if a.base_url is None:
        a.base_url = f"http://{a.host}:{a.port}"
    if a.served_model_name:
        a.model = a.served_model_name
    out = asyncio.run(benchmark(a))
    if out is None:
        return 1
    m = out["metrics"]
    print_table(m, slos, shown, a.percentiles)
    results = out["results"]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": a.base_url, "endpoint": a.endpoint, "model": a.model,
        "dataset": a.dataset_path or a.dataset_name, "num_prompts": len(results),
        "request_rate": a.request_rate if a.request_rate != float("inf") else "inf",
        "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
        "ignore_eos": a.ignore_eos, "goodput_slos_ms": slos,
        "random_prefix_len": a.random_prefix_len, "stream_fraction": a.stream_fraction,
        "disconnect_fraction": a.disconnect_fraction, "request_timeout": a.request_timeout,
        "label": a.label, **metadata,
        **({"ramp_up_strategy": a.ramp_up_strategy, "ramp_up_start_rps": a.ramp_up_start_rps,
            "ramp_up_end_rps": a.ramp_up_end_rps} if a.ramp else {}),
        **m,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results], "errors": [r.error for r in results],
        "outcomes": [r.outcome or "ok" for r in results],
        "streamed": [r.streamed for r in results],
        "timeline": out["timeline"],
    }
    if a.save_detailed:
        result["generated_texts"] = [r.generated_text for r in results]
    path = result_path(a)
    path.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = [] if a.no_plots else plot(out, path.with_suffix(""))
    write_result(a, result, path)
    print(f"wrote {path}" + "".join(f", {p}" for p in result["plots"]))
    return 0 if m["completed"] else 1
