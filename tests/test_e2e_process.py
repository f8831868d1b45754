"""`ridgeline serve` as a real process: the embedded SmolLM2 end to end, and SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.server_harness import free_port


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("server did not start")


def test_default_model_answers_and_logs_memory_plan():
    # float32, the exact path: the same answer on every CPU. The 135M model's bf16 answer
    # hangs on a near-tie that the CPU's kernels decide (with AMX this one, without it
    # another: docs/cpu.md, "Which dtype `auto` picks").
    proc, url = start("--max-model-len", "1024", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=30)
        assert chat.choices[0].message.content == "The capital of France is Paris."
        assert chat.choices[0].finish_reason == "stop"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    for needle in ("Available KV cache memory", "KV cache size", "Maximum concurrency for 1024",
                   "KV cache bytes per token", "Model weights take"):
        assert needle in out, needle
    # The start-up heap is frozen out of the collector's walks before the first request.
    assert out.index("froze the start-up heap") < out.index("ready to serve")


def _read_events(resp) -> list[str]:
    return [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]


def test_sigterm_lets_in_flight_finish_then_exits_zero(tiny_dir):
    proc, url = start("--model", str(tiny_dir), "--dtype", "float32", "--shutdown-timeout", "30")
    body = {"prompt": "a", "max_tokens": 200, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(url + "/health").status_code == 503  # draining
        refused = httpx.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2})
        assert refused.status_code == 503
        events = [first[5:].strip()] + [x[5:].strip() for x in lines if x.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 200
    proc.wait(timeout=30)
    assert proc.returncode == 0


def test_shutdown_timeout_ends_streams_with_error_event(tiny_dir):
    proc, url = start("--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "1000",
                      "--shutdown-timeout", "0.5", "--max-num-seqs", "1")
    body = {"prompt": "a", "max_tokens": 990, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGTERM)
        events = [x[5:].strip() for x in lines if x.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    proc.wait(timeout=30)
    assert proc.returncode == 0


def test_cli_generate_prints_the_offline_completion(tiny_dir):
    from app import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256)
    expected = llm.generate(["Hello world"], SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False)[0].text
    llm.shutdown()
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(tiny_dir), "--dtype",
         "float32", "--max-model-len", "256", "--max-tokens", "6", "Hello world"],
        capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == expected + "\n"


def test_a_model_that_fails_to_load_ends_the_process_non_zero(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a directory without weights
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--port", str(port),
                           "--model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "model failed to load" in proc.stderr + proc.stdout
