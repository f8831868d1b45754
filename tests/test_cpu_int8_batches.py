"""A bf16 model's calls of many rows in int8 on CPUs without AMX (`--int8-batches`, on
by default there): the real SmolLM2 served as such a CPU serves it. On a host with AMX the check
runs in a process capped to AVX-512 without AMX (`RIDGELINE_CPU_ISA=avx512`: a real build
of the kernels without the tile unit, not a mock; ~1 min to compile once), elsewhere as
the host is.

What must hold: the capabilities say such calls take int8 (and never with AMX); a long
prompt's calls take the int8 kernel, so its prompt logprobs move from the exact run's,
but little; a prompt under the int8 rows runs exactly as with `--no-int8-batches`, token
for token, and so do its one-row decode steps. (Decode steps of many rows:
`tests/test_cpu_layer_call.py`.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.cpu import isa
from gpu.cpu.capabilities import resolve
from gpu.cpu.routing import INT8_MIN_ROWS

ROOT = Path(__file__).resolve().parents[1]
NATIVE = resolve(int8_batches=True)

SCRIPT = r"""
import json, sys
from app import LLM, SamplingParams
text, short = sys.argv[1], sys.argv[2]
out = {}
for prefill in (False, True):
    llm = LLM(int8_batches=prefill, dtype="bfloat16", max_model_len=512)
    try:
        caps = llm.engine.worker.wait_ready().capabilities
        scored = llm.generate([text], SamplingParams(temperature=0, max_tokens=1,
                                                     prompt_logprobs=1), use_tqdm=False)[0]
        greedy = llm.generate([short], SamplingParams(temperature=0, max_tokens=24,
                                                      ignore_eos=True), use_tqdm=False)[0]
        out[str(prefill)] = {
            "caps": [caps.int8_batches, caps.amx, caps.int8],
            "scores": [[p[0], p[2][0][0]] for p in scored.prompt_logprobs[1:]],
            "prompt_tokens": len(scored.prompt_token_ids),
            "short_tokens": len(greedy.prompt_token_ids),
            "greedy": greedy.token_ids,
        }
    finally:
        llm.shutdown()
print(json.dumps(out))
"""

TEXT = ("The KV cache is a pool carved from the memory left after the weights, rented out "
        "in blocks; the batch is whatever fits in that pool right now, re-formed every "
        "iteration. When the pool is full a request is preempted and recomputed later. "
        "Every request carries its own sampling state, and a closed connection aborts its "
        "request and frees its blocks at once. ") * 3
SHORT = "The moon"  # fewer tokens than INT8_MIN_ROWS


@pytest.fixture(scope="module")
def runs() -> dict:
    if not NATIVE.int8:
        pytest.skip("no int8 kernels here (C++ kernels not built, or neither VNNI nor AVX2)")
    env = dict(os.environ)
    if NATIVE.amx:  # the path of a CPU without AMX, on this one
        env[isa.ENV] = "avx512"
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        env.pop("ATEN_CPU_CAPABILITY", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, TEXT, SHORT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_host_with_amx_keeps_prompts_exact():
    assert not (NATIVE.amx and NATIVE.int8_batches)


def test_prompts_take_int8_only_when_on(runs):
    assert runs["True"]["caps"] == [True, False, True]
    assert runs["False"]["caps"][:2] == [False, False]


def perplexity(scores: list) -> float:
    return math.exp(-sum(logprob for logprob, _ in scores) / len(scores))


def test_a_long_prompt_scores_close_to_exact(runs):
    """The bounds leave room above what docs/cpu.md ("Prompts in int8 without AMX")
    reports for this prompt on a 135M model, the most sensitive size."""
    exact, int8 = runs["False"], runs["True"]
    assert exact["prompt_tokens"] >= INT8_MIN_ROWS
    pairs = list(zip(exact["scores"], int8["scores"], strict=True))
    top1 = sum(a[1] == b[1] for a, b in pairs) / len(pairs)
    deltas = sorted(abs(a[0] - b[0]) for a, b in pairs)
    assert top1 >= 0.9, top1
    assert deltas[len(deltas) // 2] < 0.06
    assert abs(perplexity(int8["scores"]) / perplexity(exact["scores"]) - 1) < 0.06
    assert sum(deltas) > 0  # the prompt did take the int8 kernel


def test_a_short_prompt_and_decode_stay_exact(runs):
    assert runs["False"]["short_tokens"] < INT8_MIN_ROWS
    assert runs["True"]["greedy"] == runs["False"]["greedy"]
