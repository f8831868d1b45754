"""The operator's view: vLLM's metric families, x-request-id, GET /plan, and the Grafana
dashboard and monitoring profile in docker/ — against one real server."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import httpx
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from app.config import ServerSettings
from app.engine.plan import offline_plan
from tests.server_harness import ServerThread, tiny_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "ridgeline.json"

# vLLM 0.33's bucket families (vllm/v1/metrics/buckets.py), written out here so the test
# checks the server against vLLM, not against our own constants.
LATENCY = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960,
           1920, 7680]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10,
        20, 40, 80, 160, 640, 2560]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20,
       40, 80]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200]  # 1-2-5 up to max_model_len (256 here)
# Every family vLLM's Grafana dashboard (examples/observability/prometheus_grafana) queries,
# and the ones issue 15 names besides: name -> (type, buckets).
VLLM_FAMILIES = {
    "e2e_request_latency_seconds": ("histogram", LATENCY),
    "prompt_tokens": ("counter", None),
    "generation_tokens": ("counter", None),
    "inter_token_latency_seconds": ("histogram", ITL),
    "time_per_output_token_seconds": ("histogram", ITL),
    "request_time_per_output_token_seconds": ("histogram", ITL),
    "num_requests_running": ("gauge", None),
    "num_requests_waiting": ("gauge", None),
    "time_to_first_token_seconds": ("histogram", TTFT),
    "kv_cache_usage_perc": ("gauge", None),
    "gpu_cache_usage_perc": ("gauge", None),
    "request_prompt_tokens": ("histogram", TOKENS),
    "request_generation_tokens": ("histogram", TOKENS),
    "request_success": ("counter", None),
    "request_queue_time_seconds": ("histogram", LATENCY),
    "request_prefill_time_seconds": ("histogram", LATENCY),
    "request_decode_time_seconds": ("histogram", LATENCY),
    "request_inference_time_seconds": ("histogram", LATENCY),
    "request_max_num_generation_tokens": ("histogram", TOKENS),
    "request_params_n": ("histogram", [1, 2, 5, 10, 20]),
    "request_params_max_tokens": ("histogram", TOKENS),
    "iteration_tokens_total": ("histogram", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                             8192, 16384]),
    "prefix_cache_queries": ("counter", None),
    "prefix_cache_hits": ("counter", None),
    "num_preemptions": ("counter", None),
    "cache_config_info": ("gauge", None),
}
# The names vLLM's own dashboard queries (its 13 panels), prefix swapped.
VLLM_DASHBOARD = {
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "inter_token_latency_seconds_bucket", "request_time_per_output_token_seconds_bucket",
    "num_requests_running", "num_requests_waiting", "time_to_first_token_seconds_bucket",
    "kv_cache_usage_perc", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
}


class ContextRecorder(logging.Handler):
    """Records each log line with the structlog context variables it was logged under."""

    def __init__(self):
        super().__init__()
        self.lines: list[tuple[str, dict]] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), structlog.contextvars.get_contextvars()))
        self.records.append(record)


@contextlib.contextmanager
def recording(name: str):
    """A `ContextRecorder` on logger `name` at info, for the block's duration."""
    recorder, logger = ContextRecorder(), logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with recording("ridgeline") as recorder:
        srv = ServerThread(tiny_config(tiny_dir)).start()
        srv.recorder = recorder
        body = {"model": "tiny", "prompt": "The roofline", "max_tokens": 6, "ignore_eos": True}
        srv.completion = httpx.post(srv.url + "/v1/completions", json=body | {"n": 3},
                                    headers={"X-Request-Id": "client-id.42"}, timeout=60)
        srv.streamed = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "ignore_eos": True})
        yield srv
        srv.stop()


def families(srv) -> dict:
    text = httpx.get(srv.url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_families_with_vllm_types_buckets_and_labels(server):
    found = families(server)
    for name, (kind, buckets) in VLLM_FAMILIES.items():
        fam = found.get("ridgeline:" + name)
        assert fam is not None, f"ridgeline:{name} is not exported"
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        labels = {"engine"} if name == "cache_config_info" else {"model_name", "engine"}
        for sample in fam.samples:  # vLLM's info gauge is labelled by engine, not model
            assert labels <= set(sample.labels), (name, sample.labels)
        if buckets is not None:
            les = sorted({float(s.labels["le"]) for s in fam.samples
                          if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"})
            assert les == [float(b) for b in buckets], name


def value(fam, suffix: str, **labels) -> float:
    return sum(s.value for s in fam.samples if s.name == fam.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_per_request_families_record_what_happened(server):
    assert server.completion.status_code == 200 and server.streamed.status_code == 200
    f = families(server)
    fam = lambda name: f["ridgeline:" + name]  # noqa: E731
    finished = value(fam("request_success"), "_total")
    assert finished == 4  # three choices and one chat
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_time_per_output_token_seconds", "request_inference_time_seconds",
                 "request_params_max_tokens", "request_num_preemptions"):
        assert value(fam(name), "_count") == finished, name
    assert value(fam("request_generation_tokens"), "_sum") == 3 * 6 + 4
    assert value(fam("request_params_max_tokens"), "_sum") == 3 * 6 + 4
    # n is a property of the client's request: observed once per request, not per choice.
    assert value(fam("request_params_n"), "_count") == 2
    assert value(fam("request_params_n"), "_sum") == 3 + 1
    assert value(fam("request_max_num_generation_tokens"), "_sum") == 6 + 4
    # Both the old TPOT name and ITL get every inter-token gap.
    assert value(fam("time_per_output_token_seconds"), "_count") == value(
        fam("inter_token_latency_seconds"), "_count") > 0
    steps = value(fam("iteration_tokens_total"), "_count")
    assert steps > 0 and value(fam("iteration_tokens_total"), "_sum") == (
        value(fam("prompt_tokens"), "_total") + value(fam("generation_tokens"), "_total"))
    info = fam("cache_config_info").samples[0]
    core = server.engine.core
    assert info.value == 1 and info.labels["num_gpu_blocks"] == str(core.kv_plan.num_blocks)
    assert info.labels["block_size"] == "16" and info.labels["cache_dtype"] == "float32"
    assert value(fam("gpu_cache_usage_perc"), "") == value(fam("kv_cache_usage_perc"), "")


def test_roofline_families(server):
    f = families(server)
    fam = lambda name: f["ridgeline:" + name]  # noqa: E731
    peaks = server.engine.roofline.peaks  # measured, raised where a step did better
    assert value(fam("device_peak_bandwidth_bytes_per_second"), "") == peaks.bandwidth
    assert value(fam("device_peak_flops_per_second"), "") == peaks.flops
    assert peaks.bandwidth >= server.engine.core.peaks.bandwidth
    assert value(fam("decode_mbu"), "_count") > 0 and value(fam("prefill_mfu"), "_count") > 0
    assert value(fam("step_arithmetic_intensity"), "_count") == value(
        fam("decode_mbu"), "_count") + value(fam("prefill_mfu"), "_count")
    assert value(fam("estimated_flops_per_gpu"), "_total") > 0
    assert value(fam("estimated_read_bytes_per_gpu"), "_total") > value(
        fam("estimated_write_bytes_per_gpu"), "_total") > 0
    assert value(fam("model_step_seconds"), "_total") > 0


def test_x_request_id(server):
    assert server.completion.headers["x-request-id"] == "client-id.42"
    own = server.streamed.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", own)
    for bad in ("a b", "x" * 129, "<script>"):
        got = httpx.get(server.url + "/v1/models", headers={"x-request-id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", got.headers["x-request-id"])
    assert "x-request-id" in httpx.get(server.url + "/no/such/route").headers
    assert "x-request-id" in httpx.get(server.url + "/health").headers
    # The engine loop logs a request's end in its caller's context: the id is on the line.
    ended = [ctx for msg, ctx in server.recorder.lines if msg == "request finished"]
    assert sum(ctx.get("x_request_id") == "client-id.42" for ctx in ended) == 3
    assert sum(ctx.get("x_request_id") == own for ctx in ended) == 1


def test_plan_endpoint_and_the_offline_plan_agree(server, tiny_dir):
    plan = httpx.get(server.url + "/plan").json()
    core = server.engine.core
    mem = plan["memory"]
    assert mem["num_blocks"] == core.kv_plan.num_blocks
    assert mem["kv_bytes_per_token"] == core.kv_plan.bytes_per_token == 512
    assert mem["weights_bytes"] == core.kv_plan.weights_bytes  # measured == the arithmetic
    assert mem["max_concurrency"] == round(core.kv_plan.max_concurrency, 2)
    assert plan["peaks"]["ridge_flop_per_byte"] == round(server.engine.roofline.peaks.ridge, 2)
    assert plan["roofline"]["steps"][0]["bound"] in ("memory", "compute")
    live = plan["live"]["since_start"]
    assert live["decode"]["steps"] > 0 and 0 < live["decode"]["mbu"]
    assert live["prefill"]["steps"] > 0 and 0 < live["prefill"]["mfu"]
    # `ridgeline plan` for the same settings, without serving: the same memory plan.
    offline = offline_plan(tiny_config(tiny_dir))
    # The server counts what the layers hold, oneDNN's packed copies included (a layer
    # may keep its plain weight beside one); the offline plan the checkpoint's parameters.
    held, _ = mem.pop("weights_bytes"), mem.pop("weights_gib")
    assert held >= offline["memory"].pop("weights_bytes") > 0.5 * held
    offline["memory"].pop("weights_gib")
    assert offline["memory"] == mem and offline["cost_per_step"] == plan["cost_per_step"]


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_dashboard_expression_names_an_exported_metric(server):
    exported = {s.name for f in families(server).values() for s in f.samples}
    exprs = dashboard_expressions()
    named = {n for e in exprs for n in re.findall(r"ridgeline:[A-Za-z0-9_:]+", e)}
    assert len(exprs) > 40 and len(named) > 30
    assert not named - exported, sorted(named - exported)
    assert {"ridgeline:" + n for n in VLLM_DASHBOARD} <= named  # vLLM's panels are all there
    try:
        import promql_parser
    except ImportError:
        return
    for expr in exprs:  # well-formed PromQL, when the parser is installed
        if not expr.startswith("label_values("):
            promql_parser.parse(expr.replace("$__rate_interval", "1m"))


def test_monitoring_profile():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    monitoring = {n for n, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    for name in monitoring:
        for volume in services[name]["volumes"]:
            assert (ROOT / "docker" / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["ridgeline:8000"]
    provider = yaml.safe_load(
        (ROOT / "docker/grafana/provisioning/dashboards/ridgeline.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert any(v.endswith(":/var/lib/grafana/dashboards:ro")
               for v in services["grafana"]["volumes"])


def test_every_request_leaves_an_access_line_with_an_errors_reason(server):
    """One line per request when it ends: method, path, status, duration, its request id,
    and for an error answer the reason the client was given."""
    before = len(server.recorder.lines)
    bad = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "bad-1"},
                     json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400
    httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "ok-1"})
    httpx.get(server.url + "/nowhere", headers={"X-Request-Id": "lost-1"})
    new = zip(server.recorder.lines[before:], server.recorder.records[before:])
    lines = {ctx.get("x_request_id"): (msg, rec) for (msg, ctx), rec in new
             if rec.name == "ridgeline.access"}
    msg, rec = lines["bad-1"]
    assert msg == "POST /v1/completions 400" and rec.status == 400 and rec.duration_ms >= 0
    assert "max_tokens" in rec.error
    assert lines["ok-1"][0] == "GET /v1/models 200" and not hasattr(lines["ok-1"][1], "error")
    assert lines["lost-1"][0] == "GET /nowhere 404" and "no route" in lines["lost-1"][1].error


def test_the_access_log_can_be_turned_off(tiny_dir):
    """vLLM's `--disable-uvicorn-access-log`: no access line, the answers unchanged."""
    with recording("ridgeline.access") as recorder:
        srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
            log_stats_interval=0, disable_uvicorn_access_log=True)).start()
        try:
            assert httpx.get(srv.url + "/v1/models").status_code == 200
            assert httpx.get(srv.url + "/nowhere").status_code == 404
        finally:
            srv.stop()
    assert recorder.records == []


@pytest.mark.parametrize("disabled", [False, True])
def test_the_per_request_lines_can_be_turned_off(tiny_dir, disabled):
    """vLLM's `--disable-log-requests`: no `request finished` line per request; without
    it each request leaves one, with its tokens and finish reason."""
    with recording("ridgeline.engine") as recorder:
        srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
            log_stats_interval=0, disable_log_requests=disabled)).start()
        try:
            done = httpx.post(srv.url + "/v1/completions", headers={"X-Request-Id": "req-1"},
                              json={"model": "tiny", "prompt": "x", "max_tokens": 3})
            assert done.status_code == 200
        finally:
            srv.stop()
    finished = [rec for (msg, ctx), rec in zip(recorder.lines, recorder.records)
                if msg == "request finished" and ctx.get("x_request_id") == "req-1"]
    if disabled:
        assert finished == []
    else:
        assert len(finished) == 1 and finished[0].output_tokens == 3

