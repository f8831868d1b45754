"""`ridgeline bench serve` takes `vllm bench serve`'s flags with vLLM's meaning.

What reaches the server (headers, x-request-id, body fields, warm-ups, profiler calls)
is read by a recording aiohttp server written here; the result file's flags run against
the real server; the ramp-up against vLLM's formula.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer as AiohttpTestServer

from app.bench.serve import run
from app.bench.workload import arrival_gaps, check_ramp
from app.cli import build_parser
from tests.server_harness import ServerThread, metric, tiny_config


def parse(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


class Recorder:
    """A minimal OpenAI-compatible server that streams two tokens and records requests."""

    def __init__(self):
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        self.app.router.add_post("/start_profile", self.profile)
        self.app.router.add_post("/stop_profile", self.profile)

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake", "root": "fake"}]})

    async def profile(self, request):
        self.requests.append((request.path, {}, {}))
        return web.json_response({})

    async def completions(self, request):
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append((request.path, headers, body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            piece = ({"delta": {"content": text}} if request.path.endswith("chat/completions")
                     else {"text": text})
            chunk = {"choices": [{"index": 0, **piece, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@contextlib.asynccontextmanager
async def recording():
    """Started in the test's own event loop, which runs while `run` works in a thread."""
    rec = Recorder()
    server = AiohttpTestServer(rec.app, host="127.0.0.1")
    await server.start_server()
    rec.url = str(server.make_url("")).rstrip("/")
    try:
        yield rec
    finally:
        await server.close()


async def test_headers_ids_body_warmups_and_profile_reach_the_server(tmp_path):
    async with recording() as recorder:
        await _headers_ids_body(recorder, tmp_path)


async def _headers_ids_body(recorder: Recorder, tmp_path) -> None:
    args = parse("--base-url", recorder.url, "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "2", "--no-plots", "--disable-tqdm",
                 "--result-dir", str(tmp_path), "--metrics-interval", "5",
                 "--header", "x-team=bench", "Authorization=Bearer k1",
                 "--extra-body", '{"min_tokens": 2, "top_k": 5}',
                 "--request-id-prefix", "run7-", "--logprobs", "1",
                 "--num-warmups", "2", "--profile", "--trust-remote-code",
                 "--ready-check-timeout-sec", "5")
    assert await asyncio.to_thread(run, args) == 0
    paths = [p for p, _, _ in recorder.requests]
    # the test request, 2 warm-ups, the profiler around the 3 measured ones
    assert paths == ["/v1/completions"] * 3 + ["/start_profile"] + ["/v1/completions"] * 3 \
        + ["/stop_profile"]
    measured = recorder.requests[4:7]
    assert sorted(h["x-request-id"] for _, h, _ in measured) == ["run7-0", "run7-1", "run7-2"]
    for path, headers, body in recorder.requests:
        if not path.endswith("completions"):
            continue
        assert headers["x-team"] == "bench" and headers["authorization"] == "Bearer k1"
        assert body["min_tokens"] == 2 and body["top_k"] == 5 and body["logprobs"] == 1


async def test_chat_gets_no_logprobs_as_in_vllm(tmp_path):
    async with recording() as recorder:
        args = parse("--base-url", recorder.url, "--backend", "openai-chat", "--num-prompts",
                     "1", "--input-len", "8", "--output-len", "2", "--no-plots",
                     "--disable-tqdm", "--result-dir", str(tmp_path), "--logprobs", "1",
                     "--metrics-interval", "5")
        assert await asyncio.to_thread(run, args) == 0
    assert all("logprobs" not in body for _, _, body in recorder.requests)
    assert recorder.requests[-1][1]["x-request-id"].startswith("bench-")


def test_bad_flag_values_are_refused_before_any_traffic(tmp_path, capsys):
    base = ["--base-url", "http://127.0.0.1:1", "--result-dir", str(tmp_path)]
    for extra, words in [(["--header", "nokey"], "--header"),
                         (["--metadata", "x"], "--metadata"),
                         (["--ramp-up-strategy", "linear"], "--ramp-up-start-rps"),
                         (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "5",
                           "--ramp-up-end-rps", "9", "--request-rate", "3"], "--request-rate"),
                         (["--ramp-up-start-rps", "1"], "--ramp-up-strategy"),
                         (["--extra-body", "[1]"], "--extra-body")]:
        assert run(parse(*base, *extra)) == 2
        assert words in capsys.readouterr().out


def test_ramp_up_follows_vllms_rates():
    assert check_ramp(None, None, None, float("inf")) is None
    with pytest.raises(ValueError, match="positive"):
        check_ramp("exponential", 0, 10, float("inf"))
    n, start, end = 4000, 2.0, 200.0
    vllm_rates = {  # vLLM's _get_current_request_rate, written out
        "linear": [start + (end - start) * i / (n - 1) for i in range(n)],
        "exponential": [start * (end / start) ** (i / (n - 1)) for i in range(n)]}
    for strategy, rates in vllm_rates.items():
        gaps = arrival_gaps(n, float("inf"), 1.0, 0, (strategy, start, end))
        # each gap is exponential with mean 1 / its rate: scaled by the rate, mean 1
        scaled = [g * r for g, r in zip(gaps, rates)]
        assert statistics.mean(scaled) == pytest.approx(1.0, rel=0.06)
        assert statistics.mean(scaled[: n // 4]) == pytest.approx(1.0, rel=0.12)
        assert statistics.mean(scaled[-n // 4:]) == pytest.approx(1.0, rel=0.12)
    # and the rates do differ: the first quarter waits far longer than the last
    lin = arrival_gaps(n, float("inf"), 1.0, 0, ("linear", start, end))
    assert statistics.mean(lin[: n // 4]) > 5 * statistics.mean(lin[-n // 4:])


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=8)).start()
    yield srv
    srv.stop()


def test_label_metadata_detailed_and_appended_results(server, tmp_path):
    import httpx

    before = metric(httpx.get(server.url + "/metrics").text, "request_success_total")
    argv = ["--base-url", server.url, "--num-prompts", "3", "--input-len", "8",
            "--output-len", "4", "--ignore-eos", "--no-plots", "--disable-tqdm",
            "--result-dir", str(tmp_path), "--label", "nightly", "--append-result",
            "--metadata", "gpu=none", "tp=1", "--save-detailed", "--num-warmups", "2",
            "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20",
            "--ramp-up-end-rps", "60", "--metrics-interval", "0.1"]
    assert run(parse(*argv)) == 0
    assert run(parse(*argv)) == 0
    path = tmp_path / "nightly-serve.json"
    runs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(runs) == 2
    for r in runs:
        assert r["label"] == "nightly" and r["gpu"] == "none" and r["tp"] == "1"
        assert r["completed"] == 3 and r["ramp_up_strategy"] == "linear"
        assert len(r["generated_texts"]) == 3 and all(r["generated_texts"])
    after = metric(httpx.get(server.url + "/metrics").text, "request_success_total")
    assert after - before == 2 * (1 + 2 + 3)  # per run: the test request, warm-ups, measured
    plain = ["--base-url", server.url, "--num-prompts", "1", "--output-len", "2", "--no-plots",
             "--disable-tqdm", "--result-dir", str(tmp_path / "plain")]
    assert run(parse(*plain)) == 0
    assert "generated_texts" not in json.loads((tmp_path / "plain" / "serve.json").read_text())
