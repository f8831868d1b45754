"""The HTTP checks docker/test.sh runs against a container, from the host, standard library only.

Each check talks to a server as a client would and exits non-zero with the reason when the
server does not behave: `python3 docker/checks.py CHECK BASE_URL [ARG]`.

- `ready URL [SECONDS]`: /health answers 200 within the time (the model loaded).
- `complete URL [MODEL]`: /v1/models lists MODEL (or one model), a completion returns text.
- `stream URL`: a streamed completion arrives event by event, not in one burst at the end:
  many `data:` events, most with their own arrival time, spread over the generation.
- `abort URL`: a client that leaves mid-stream aborts its request: the KV-cache usage
  gauge is above 0 while it streams and back to 0 soon after the connection closes.
- `drain URL CONTAINER`: `docker stop` during a stream: the stream still ends with its
  last token and [DONE], and a new request in the meantime gets 503 (draining).
- `requests URL N [MODEL]`: N completions in a row all succeed (through the router).
- `model URL`: print the first model /v1/models lists.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

KV_GAUGE = "ridgeline:kv_cache_usage_perc"  # app/engine/metrics.py
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode()}


def model_id(base: str) -> str:
    return json.loads(get(base + "/v1/models")[1])["data"][0]["id"]


def open_stream(base: str, max_tokens: int) -> tuple[http.client.HTTPConnection, object]:
    """A streamed completion that generates exactly max_tokens tokens (ignore_eos)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = {"model": model_id(base), "prompt": PROMPT, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        fail(f"stream answered {resp.status}: {resp.read()[:300]!r}")
    return conn, resp


def events(resp):
    """(arrival time, payload) for each `data:` line, as it arrives."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().strip()
        if line.startswith("data:"):
            yield time.monotonic(), line[5:].strip()


def kv_usage(base: str) -> float:
    text = get(base + "/metrics")[1]
    m = re.search(rf"^{re.escape(KV_GAUGE)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    if not m:
        fail(f"/metrics has no {KV_GAUGE}")
    return float(m.group(1))


def ready(base: str, seconds: str = "600") -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < float(seconds):
        try:
            if get(base + "/health", timeout=5)[0] == 200:
                print(f"ready after {time.monotonic() - t0:.1f} s of polling")
                return
        except OSError:
            pass
        time.sleep(0.5)
    fail(f"/health not 200 within {seconds} s")


def complete(base: str, want: str = "") -> None:
    ids = [m["id"] for m in json.loads(get(base + "/v1/models")[1])["data"]]
    if want and want not in ids:
        fail(f"/v1/models lists {ids}, not {want}")
    status, body = post(base + "/v1/completions",
                        {"model": ids[0], "prompt": "The capital of France is",
                         "max_tokens": 8, "temperature": 0})
    text = body.get("choices", [{}])[0].get("text", "") if status == 200 else ""
    if not text.strip():
        fail(f"completion answered {status}: {body}")
    print(f"model {ids[0]!r} completes: {text!r}")


def stream(base: str) -> None:
    conn, resp = open_stream(base, 48)
    got = list(events(resp))
    conn.close()
    if not got or got[-1][1] != "[DONE]":
        fail("the stream did not end with [DONE]")
    times = [t for t, _ in got[:-1]]
    distinct = len({round(t, 3) for t in times})
    span = times[-1] - times[0]
    # One event per decode step; the first may carry the prompt's echo or the role.
    if len(times) < 40 or distinct < len(times) // 2 or span < 0.2:
        fail(f"{len(times)} events, {distinct} distinct arrival times over {span:.3f} s: "
             "the stream was buffered")
    print(f"{len(times)} events, {distinct} distinct arrival times over {span:.2f} s")


def abort(base: str) -> None:
    conn, resp = open_stream(base, 4000)
    it = events(resp)
    for _ in range(5):
        next(it)
    during = kv_usage(base)
    if during <= 0:
        fail(f"{KV_GAUGE} is {during} while a stream runs")
    conn.sock.close()  # the client leaves mid-stream
    conn.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        if kv_usage(base) == 0:
            print(f"KV usage {during:.4f} while streaming, 0 after "
                  f"{time.monotonic() - t0:.2f} s once the client left")
            return
        time.sleep(0.1)
    fail(f"{KV_GAUGE} still {kv_usage(base)} 30 s after the client left")


def drain(base: str, container: str) -> None:
    model = model_id(base)
    conn, resp = open_stream(base, 160)
    it = events(resp)
    for _ in range(3):
        next(it)
    stop = subprocess.Popen(["docker", "stop", "--time", "60", container],
                            stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # the signal reaches the server and it starts draining
    try:
        status, _ = post(base + "/v1/completions", {"model": model, "prompt": "hi",
                                                    "max_tokens": 4})
    except OSError as e:  # the server closed its socket: it did not wait for the stream
        status = repr(e)
    rest = [p for _, p in it]
    conn.close()
    last = json.loads(rest[-2]) if len(rest) >= 2 else {}
    reason = last.get("choices", [{}])[0].get("finish_reason")
    if rest[-1:] != ["[DONE]"] or reason != "length":
        fail(f"the stream in flight did not finish: last events {rest[-2:]}")
    if status != 503:
        fail(f"a new request while draining got {status}, not 503")
    if stop.wait(90) != 0:
        fail("docker stop failed")
    print(f"the stream in flight finished ({reason}, {len(rest) + 3} events) "
          "and a new request during the drain got 503")


def requests(base: str, n: str, model: str = "") -> None:
    model = model or model_id(base)
    slowest = 0.0
    for i in range(int(n)):
        t0 = time.monotonic()
        status, body = post(base + "/v1/completions",
                            {"model": model, "prompt": f"Count to {i + 3}:", "max_tokens": 4})
        slowest = max(slowest, time.monotonic() - t0)
        if status != 200:
            fail(f"request {i} answered {status}: {body}")
    print(f"{n} requests, all 200 (the slowest took {slowest:.1f} s)")


if __name__ == "__main__":
    check, *args = sys.argv[1:]
    {"ready": ready, "complete": complete, "stream": stream, "abort": abort,
     "drain": drain, "requests": requests,
     "model": lambda base: print(model_id(base))}[check](*args)
