"""The flags of `ridgeline bench serve`, named as `vllm bench serve` names them.

Kept apart from `serve.py` so that building the CLI imports nothing heavy. Where
Ridgeline had a name first it stays as an alias (`--input-len` beside
`--random-input-len`).
"""

from __future__ import annotations

import argparse
import json
import os

BACKEND_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}


class _Backend(argparse.Action):
    """vLLM's `--backend` picks the endpoint; `--endpoint` still wins when given after."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.endpoint = BACKEND_ENDPOINTS[value]


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("--base-url", default=None,
                   help="the server (default: http://HOST:PORT)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--backend", choices=sorted(BACKEND_ENDPOINTS), action=_Backend,
                   help="vLLM's name for the endpoint: openai-chat means /v1/chat/completions")
    v.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    v.add_argument("--model", default=None, help="default: the server's first model")
    v.add_argument("--served-model-name", default=None,
                   help="the name sent in requests, when it differs from --model")
    v.add_argument("--lora-modules", nargs="+", default=None,
                   help="LoRA adapters the server serves: each request names one at random "
                   "(seeded by --seed) instead of --model (vLLM's flag)")
    v.add_argument("--tokenizer", default=None,
                   help="count prompt tokens locally with this HF tokenizer (needs the "
                   "engine extra); default: the server's /tokenize")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="let --tokenizer run the tokenizer code its directory ships "
                   "(transformers' trust_remote_code); without --tokenizer nothing here "
                   "loads a tokenizer, and the flag changes nothing")
    v.add_argument("--api-key", default=os.environ.get("RIDGELINE_API_KEY"))
    v.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE",
                   help="headers sent with every request (a request's own x-request-id "
                   "wins)")
    v.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="a JSON object merged into every request body, e.g. "
                   "'{\"chat_template_kwargs\": {\"enable_thinking\": false}}'")
    v.add_argument("--request-id-prefix", default=None,
                   help="each request is sent with x-request-id PREFIX + its index "
                   "(default: bench-<8 random hex>-)")
    v.add_argument("--logprobs", type=int, default=None,
                   help="logprobs per token asked of /v1/completions (as vLLM's benchmark, "
                   "not sent to chat)")
    v.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="retry the first test request for up to this many seconds while the "
                   "server is not ready yet; 0: one try")
    v.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (the test prompt, within --max-concurrency) before "
                   "the measured run, and not counted")
    v.add_argument("--profile", action="store_true",
                   help="POST /start_profile before the run and /stop_profile after it, "
                   "as vLLM's benchmark does; a server without them (Ridgeline has no "
                   "profiler endpoints) answers 404 and the run goes on unprofiled")
    v.add_argument("--dataset-name", default="random",
                   choices=["random", "sharegpt", "prefix_repetition"])
    v.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON")
    v.add_argument("--num-prompts", type=int, default=100)
    v.add_argument("--random-input-len", "--input-len", dest="input_len", type=int,
                   default=128)
    v.add_argument("--random-output-len", "--output-len", dest="output_len", type=int,
                   default=128)
    v.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one prefix shared by every prompt (a system prompt)")
    v.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths in [len*(1-r), len*(1+r)]")
    v.add_argument("--sharegpt-output-len", type=int, default=None)
    v.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    v.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    v.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    v.add_argument("--prefix-repetition-output-len", type=int, default=128)
    v.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s (inf: all at once)")
    v.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrivals: 1 Poisson, <1 burstier")
    v.add_argument("--ramp-up-strategy", choices=["linear", "exponential"], default=None,
                   help="raise the request rate from --ramp-up-start-rps to "
                   "--ramp-up-end-rps over the run (instead of --request-rate)")
    v.add_argument("--ramp-up-start-rps", type=int, default=None)
    v.add_argument("--ramp-up-end-rps", type=int, default=None)
    v.add_argument("--max-concurrency", type=int, default=None)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--ignore-eos", action="store_true")
    v.add_argument("--temperature", type=float, default=0.0)
    v.add_argument("--top-p", type=float, default=None)
    v.add_argument("--top-k", type=int, default=None)
    v.add_argument("--min-p", type=float, default=None)
    v.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    v.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="which latencies get percentiles in the table")
    v.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    # Overload soaks (Ridgeline's own).
    v.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a client waits for its answer before leaving; sent to the "
                   "server as X-Request-Timeout")
    v.add_argument("--stream-fraction", type=float, default=1.0,
                   help="share of requests that stream (the rest wait for the whole answer)")
    v.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of requests whose client leaves after a random 0.2-10 s")
    v.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between samples of the server's /metrics")
    v.add_argument("--result-dir", default="bench_results")
    v.add_argument("--result-filename", default=None,
                   help="default: serve.json, or LABEL-serve.json with --label")
    v.add_argument("--label", default=None,
                   help="the run's label: in the result JSON and its file name's prefix")
    v.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="written into the result JSON, for record keeping")
    v.add_argument("--save-result", action="store_true",
                   help="accepted for vLLM command lines: the result JSON is always written")
    v.add_argument("--save-detailed", action="store_true",
                   help="add each request's generated text to the result JSON (the other "
                   "per-request lists, lengths, latencies, errors, are always written)")
    v.add_argument("--append-result", action="store_true",
                   help="append the result as one JSON line to the file instead of "
                   "replacing it")
    v.add_argument("--no-plots", action="store_true")
    v.add_argument("--disable-tqdm", action="store_true")
