"""The flags of `ridgeline bench serve`, named as `vllm bench serve` names them.

Kept apart from `serve.py` so that building the CLI imports nothing heavy. Where
Ridgeline had a name first it stays as an alias (`--input-len` beside
`--random-input-len`).
"""

from __future__ import annotations

import argparse
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
    v.add_argument("--tokenizer", default=None,
                   help="count prompt tokens locally with this HF tokenizer (needs the "
                   "engine extra); default: the server's /tokenize")
    v.add_argument("--api-key", default=os.environ.get("RIDGELINE_API_KEY"))
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
    v.add_argument("--result-filename", default="serve.json")
    v.add_argument("--save-result", action="store_true",
                   help="accepted for vLLM command lines: the result JSON is always written")
    v.add_argument("--no-plots", action="store_true")
    v.add_argument("--disable-tqdm", action="store_true")
