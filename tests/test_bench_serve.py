"""`ridgeline bench serve`: the metric definitions on synthetic timings, then a short real run."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from app.bench.overhead import histogram_quantile, overhead_numbers
from app.bench.report import RequestResult, compute_metrics, parse_goodput, tpot
from app.bench.serve import run
from app.bench.workload import TokenCounter, arrival_gaps, sharegpt_requests
from app.cli import build_parser
from app.client import AsyncClient
from models.tiny import make_tiny_llama
from tests.server_harness import ServerThread, tiny_config


def result(ttft: float, latency: float, out: int, itl: list[float] | None = None,
           prompt: int = 10) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_tokens=out, ttft=ttft,
                         latency=latency, itl=itl or [])


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert tpot(result(0.1, 1.1, 11)) == pytest.approx(0.1)  # (1.1 - 0.1) / (11 - 1)
    assert tpot(result(0.2, 0.2, 1)) == 0.0  # one token: no decode, 0 as in vLLM
    m = compute_metrics([result(0.1, 1.1, 11), result(0.3, 0.7, 5), result(0.2, 0.2, 1)],
                        duration=2.0, slos={})
    # TPOT statistics only cover requests with more than one token: 100 ms and 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_e2el_ms"] == pytest.approx(700.0)


def test_itl_is_pooled_and_throughputs():
    rs = [result(0.1, 0.4, 4, [0.1, 0.1, 0.1]), result(0.1, 0.3, 2, [0.2])]
    rs.append(RequestResult(success=False, prompt_len=10, error="HTTP 503"))
    m = compute_metrics(rs, duration=2.0, slos={})
    pooled = [100.0, 100.0, 100.0, 200.0]
    assert m["mean_itl_ms"] == pytest.approx(statistics.mean(pooled))  # 125, not 150
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 13.0
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    rs = [
        result(0.05, 1.05, 11),  # ttft 50 ms, tpot 100 ms, e2e 1050 ms: good
        result(0.30, 1.30, 11),  # ttft 300 ms: misses the TTFT SLO
        result(0.05, 2.05, 11),  # tpot 200 ms: misses the TPOT SLO
        result(0.10, 0.10, 1),   # one token: tpot counts as 0, good
    ]
    slos = parse_goodput(["ttft:200", "tpot:150"])
    assert slos == {"ttft": 200.0, "tpot": 150.0}
    assert compute_metrics(rs, 2.0, slos)["request_goodput"] == pytest.approx(2 / 2.0)
    slos = parse_goodput(["ttft:200", "tpot:150", "e2el:1000"])
    assert compute_metrics(rs, 2.0, slos)["request_goodput"] == pytest.approx(1 / 2.0)
    with pytest.raises(ValueError):
        parse_goodput(["ttfx:3"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft:fast"])


def test_arrivals_poisson_mean_and_infinite_rate():
    assert arrival_gaps(5, float("inf"), 1.0, 0) == [0.0] * 5
    gaps = arrival_gaps(4000, 10.0, 1.0, 0)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_gaps(4000, 10.0, 0.25, 0)  # same mean, larger spread
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(gaps)


async def test_sharegpt_filters_and_word_count_fallback(tmp_path):
    def conv(prompt_words: int, reply_words: int) -> dict:
        return {"conversations": [{"from": "human", "value": " ".join(["w"] * prompt_words)},
                                  {"from": "gpt", "value": " ".join(["r"] * reply_words)}]}

    data = [conv(10, 10), conv(2, 10), conv(10, 2), conv(900, 10), conv(20, 30),
            {"conversations": [{"from": "human", "value": "alone"}]}, conv(40, 5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    async with AsyncClient("http://127.0.0.1:1", max_retries=0) as c:  # nothing listens
        count = TokenCounter(c, None)
        specs = await sharegpt_requests(str(path), 10, 0, count, None)
        assert not count.exact  # no /tokenize: words x 1.3
        # too short a prompt or reply (< 4 tokens) or too long a prompt (> 1024) are dropped
        assert sorted((s.prompt_len, s.output_len) for s in specs) == [(13, 13), (26, 39),
                                                                      (52, 6)]
        fixed = await sharegpt_requests(str(path), 2, 0, count, 7)
        assert len(fixed) == 2 and all(s.output_len == 7 for s in fixed)


def test_overhead_reads_the_load_share_of_the_metrics():
    """bench overhead: p99 from histogram buckets, per-token time from two counters."""
    assert histogram_quantile(0.5, [(0.001, 50.0), (0.005, 100.0), (math.inf, 100.0)]) == 0.001
    # rank 99 of 100 falls in (0.005, 0.01], 4 of its 5 observations in: 0.005 + 0.8 * 0.005
    cum = [(0.001, 90.0), (0.005, 95.0), (0.01, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.99, cum) == pytest.approx(0.009)
    assert histogram_quantile(0.99, [(0.01, 1.0), (math.inf, 10.0)]) == 0.01  # past the last
    assert math.isnan(histogram_quantile(0.99, [(math.inf, 0.0)]))

    def text(lag: list[float], overhead: float, tokens: float) -> str:
        lines = [f'ridgeline:event_loop_lag_seconds_bucket{{le="{le}",model_name="m"}} {v}'
                 for le, v in zip(("0.001", "0.01", "+Inf"), lag)]
        return "\n".join(lines + [
            f'ridgeline:event_loop_lag_seconds_count{{model_name="m"}} {lag[-1]}',
            'ridgeline:event_loop_lag_seconds_sum{model_name="m"} 0.0',
            f'ridgeline:step_overhead_seconds_total{{model_name="m"}} {overhead}',
            f'ridgeline:generation_tokens_total{{model_name="m"}} {tokens}'])

    # before the load: 1000 idle samples under 1 ms; the load adds 100, 10 of them late
    nums = overhead_numbers(text([1000, 1000, 1000], 1.0, 5000),
                            text([1090, 1100, 1100], 1.5, 15000))
    assert nums["lag_samples"] == 100 and nums["generation_tokens"] == 10000
    assert nums["lag_p99_ms"] == pytest.approx(0.001 * 1e3 + 0.9 * 9.0)  # in (1, 10] ms
    assert nums["us_per_token_outside_model"] == pytest.approx(50.0)  # 0.5 s / 10000


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_dir)
    srv = ServerThread(tiny_config(tiny, max_num_seqs=8)).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_real_run_writes_result_json(server, tmp_path, endpoint):
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server.url, "--endpoint", endpoint,
        "--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--ignore-eos",
        "--request-rate", "50", "--max-concurrency", "4", "--goodput", "ttft:60000",
        "--metrics-interval", "0.05", "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert run(args) == 0
    r = json.loads((tmp_path / "serve.json").read_text())
    assert r["model"] == "tiny" and r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == 6 * 8 and r["output_lens"] == [8] * 6
    assert r["total_input_tokens"] == sum(r["input_lens"]) > 6 * 8  # from the server's usage
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert len(r["itls"]) == 6 and all(len(gaps) >= 1 for gaps in r["itls"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert r[f"{stat}_{key}_ms"] > 0
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["timeline"]["t"] and any(v is not None for v in r["timeline"]["running_server"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r["plots"] == []
    else:
        assert [p.rsplit("/", 1)[-1] for p in r["plots"]] == ["serve_latency_cdf.png",
                                                              "serve_timeline.png"]
        assert all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 1000 for p in r["plots"])


def test_unreachable_server_fails_cleanly(tmp_path):
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2",
        "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert run(args) == 1 and not (tmp_path / "serve.json").exists()
