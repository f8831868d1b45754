"""Grammar compiles are bounded (issue 40, item 2 and the grammar parts of 5 and 10).

Through the real server with a tiny model and a short compile bound: cheap bounds
(spec bytes, nesting, enum/choice options, schema keywords, tool schemas too) are
400s naming the field before any compile; a costly compile is killed at its time
bound (a 400) and its worker replaced; it does not hold up a short regex; a client that
leaves kills its compile; the cache is an LRU bounded by bytes. Without a server: the
memory bound, and shutdown killing a compile at once (what SIGTERM relies on).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from app.engine.grammar import GrammarLimits, GrammarService, StructuredOutput
from app.engine.grammar_bounds import MAX_DEPTH, MAX_OPTIONS
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

pytest.importorskip("xgrammar")

BOUND_S = 5.0  # the compile time bound of this module's server
SPEC_BYTES = 384 << 10


def costly_schema(tag: str, n: int = 10000) -> dict:
    """An object of n required properties: ~250 KB that compiles in tens of seconds."""
    return {"type": "object", "title": tag, "required": [f"p{i}" for i in range(n)],
            "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def rf(schema) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(
        tiny_dir, max_model_len=256, grammar_compile_timeout=BOUND_S,
        # Memory enough that the time bound, not the memory one, stops the costly
        # compiles here (a fast CPU reaches the default 512 MiB within 5 s).
        grammar_compile_memory=4 << 30,
        grammar_max_spec_bytes=SPEC_BYTES, grammar_cache_bytes=1 << 20)).start()
    chat(srv, guided_regex="[0-9]{2}")  # the workers are up before any timing
    yield srv
    srv.stop()


def chat(srv, timeout: float = 60, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body})


def grammars(srv) -> GrammarService:
    return srv.engine.core.grammars


def alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie (gone for our purposes). A process
    reaped between the signal and the read of its stat is gone too."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def wait_quiet(srv) -> None:
    """Until every worker is ready and idle (a killed one replaced), nothing queued."""
    pool = grammars(srv).pool
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(pool.pids()) == len(pool.workers) and not pool._queue and all(
                w.job is None for w in pool.workers):
            return
        time.sleep(0.1)
    raise AssertionError("the grammar workers did not settle")


def nested(depth: int) -> str:
    return '{"type":"array","items":' * depth + "{}" + "}" * depth


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "not": {"const": "x"}}}}}}


@pytest.mark.parametrize("body,param,words", [
    (rf({"enum": [f"v{i}" for i in range(MAX_OPTIONS + 1)]}),
     "response_format.json_schema.schema", "enum values"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(MAX_OPTIONS + 1)]}},
     "structured_outputs.choice", "options"),
    ({"guided_regex": "|".join(f"alt{i}" for i in range(SPEC_BYTES // 6))},
     "guided_regex", "grammar-max-spec-bytes"),
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(
        f'"w{i}"' for i in range(SPEC_BYTES // 6))}}, "structured_outputs.grammar",
     "grammar-max-spec-bytes"),
    (rf(json.loads(nested(MAX_DEPTH + 1))), "response_format.json_schema.schema", "levels"),
    ({"guided_json": nested(3000)}, "guided_json", "levels"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tools[0].function.parameters",
     "'properties.city.not'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "weather"}}}, "tools[0].function.parameters", "not"),
])
def test_cheap_bounds_are_400s_naming_the_field(server, body, param, words):
    t = time.monotonic()
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert time.monotonic() - t < 3  # refused before compiling


def test_generate_json_schema_nested_3000_deep_is_a_400(server):
    r = httpx.post(server.url + "/generate", timeout=30, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": nested(3000)}})
    assert r.status_code == 400, r.text  # was a RecursionError: 500
    assert r.json()["error"]["param"] == "sampling_params.json_schema"


def test_tool_schemas_shown_but_not_enforced_are_not_refused(server):
    r = chat(server, tools=[WEATHER], tool_choice="auto")
    assert r.status_code == 200, r.text


def test_a_costly_compile_is_a_400_at_its_time_bound_and_its_worker_replaced(server):
    wait_quiet(server)
    before = set(grammars(server).pool.pids())
    t = time.monotonic()
    r = chat(server, timeout=120, **rf(costly_schema("time")))
    elapsed = time.monotonic() - t
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema", err
    assert "too costly to compile" in err["message"], err
    assert BOUND_S - 0.5 < elapsed < BOUND_S + 10, elapsed
    killed = before - set(grammars(server).pool.pids())
    assert len(killed) == 1 and not any(alive(p) for p in killed)
    wait_quiet(server)  # replaced
    assert_idle_and_clean(server)


def test_a_short_regex_is_not_held_up_by_costly_compiles(server):
    wait_quiet(server)
    # Two costly compiles: each would hold a worker for the whole bound.
    def leave_after_3s(tag: str) -> None:
        with pytest.raises(httpx.ReadTimeout):
            chat(server, timeout=3, **rf(costly_schema(tag)))

    costly = [threading.Thread(target=leave_after_3s, args=(f"block{i}",), daemon=True)
              for i in range(2)]
    for th in costly:
        th.start()
    time.sleep(0.5)
    t = time.monotonic()
    r = chat(server, structured_outputs={"regex": "(yes|no|maybe) [0-9]{1,3} ok"})
    elapsed = time.monotonic() - t
    assert r.status_code == 200, r.text
    assert elapsed < 2.5, elapsed  # not behind a costly compile (the bound is 5 s)
    for th in costly:
        th.join(30)


def test_a_compile_queued_past_the_bound_is_a_503(server):
    wait_quiet(server)
    results: dict[str, tuple[int, dict, float]] = {}

    def send(tag: str) -> None:
        t = time.monotonic()
        r = chat(server, timeout=120, **rf(costly_schema(tag)))
        results[tag] = (r.status_code, dict(r.headers), time.monotonic() - t)

    threads = [threading.Thread(target=send, args=(tag,)) for tag in ("first", "queued")]
    for th in threads:
        th.start()
        time.sleep(0.3)
    for th in threads:
        th.join(120)
    assert results["first"][0] == 400  # at its time bound
    status, headers, elapsed = results["queued"]
    assert status == 503 and "retry-after" in headers, results
    assert elapsed < 2 * BOUND_S + 20, elapsed  # never behind a whole queue


def test_a_compile_whose_client_left_is_killed(server):
    pool = grammars(server).pool
    wait_quiet(server)
    before = set(pool.pids())
    t = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        chat(server, timeout=1.0, **rf(costly_schema("left")))
    while before <= set(pool.pids()) and time.monotonic() - t < BOUND_S:
        time.sleep(0.05)
    gone = before - set(pool.pids())
    assert len(gone) == 1, (before, pool.pids())
    assert time.monotonic() - t < BOUND_S - 1  # killed for leaving, not at the bound
    assert not any(alive(p) for p in gone)
    assert not grammars(server)._jobs  # nothing left waiting


def test_the_cache_is_an_lru_bounded_by_bytes(server):
    svc = grammars(server)

    def schema(title: str) -> StructuredOutput:
        return StructuredOutput.json_schema({"type": "object", "title": title,
                                             "properties": {"a": {"type": "string"}}})

    svc.compile_now(schema("reused"))
    for i in range(60):
        svc.compile_now(schema(f"s{i}"))
        assert svc.cached(schema("reused")) is not None  # used again: kept
        assert 0 < svc.cache_bytes <= 1 << 20  # --grammar-cache-bytes of this server
    assert svc.cached(schema("s0")) is None  # the least recently used went first
    assert svc.cached(schema("s59")) is not None
    assert len(svc._cache) < 61


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def service(tokenizer, **limits) -> GrammarService:
    return GrammarService(tokenizer, 49152, (2,), GrammarLimits(**limits))


def test_a_compile_past_its_memory_bound_is_refused(tokenizer):
    svc = service(tokenizer, compile_memory=48 << 20, workers=1, max_spec_bytes=1 << 20,
                  compile_timeout=120)
    try:
        svc.compile_now(StructuredOutput("regex", "[a-z]+"))  # small: fits
        pid = svc.pool.pids()[0]
        big = "root ::= " + " | ".join(f'"option-{i}"' for i in range(30000))
        with pytest.raises(ValueError, match="too costly to compile.*memory"):
            svc.compile_now(StructuredOutput("grammar", big), "structured_outputs.grammar")
        assert not alive(pid)
        assert svc.compile_now(StructuredOutput("regex", "[0-9]+")) is not None  # replaced
    finally:
        svc.shutdown()


def test_shutdown_kills_a_running_compile_at_once(tokenizer):
    svc = service(tokenizer, compile_timeout=120, max_spec_bytes=1 << 20, compile_memory=4 << 30)
    svc.compile_now(StructuredOutput("regex", "[a-z]+"))
    pids = svc.pool.pids()
    errors: list[Exception] = []

    def run() -> None:
        try:
            svc.compile_now(StructuredOutput.json_schema(costly_schema("stop", 20000)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 60
    while not any(w.job for w in svc.pool.workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # compiling
    t = time.monotonic()
    svc.shutdown()
    th.join(10)
    assert not th.is_alive() and time.monotonic() - t < 3
    assert errors and "shutting down" in str(errors[0])
    assert not any(alive(p) for p in pids)


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


def test_sigterm_exits_promptly_while_a_costly_compile_runs(tiny_dir):
    from tests.test_e2e_process import start

    proc, url = start("--model", str(tiny_dir), "--dtype", "float32", "--shutdown-timeout",
                      "1", "--grammar-compile-timeout", "300", "--grammar-max-spec-bytes",
                      "2MiB")
    try:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": "a", "max_tokens": 2, "structured_outputs": {"regex": "[0-9]+"}})
        assert r.status_code == 200, r.text
        workers = children(proc.pid)
        assert workers

        def costly() -> None:  # ends with the server: an error or a 503, whichever
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(url + "/v1/completions", timeout=60, json={
                    "prompt": "a", "max_tokens": 2, **rf(costly_schema("sigterm", 20000))})

        th = threading.Thread(target=costly, daemon=True)
        th.start()
        time.sleep(1.5)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # the compile alone would run for minutes
        assert time.monotonic() - t < 15
        assert not any(alive(p) for p in workers)
    finally:
        proc.kill()
        proc.wait()
