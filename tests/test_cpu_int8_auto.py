"""`--dtype auto` on a CPU without bf16 arithmetic (AVX2) serves float32 with int8
activations in every call of a GGUF's layers (`gpu.dtypes.int8_activations_asked`);
`--dtype float32`, or `--no-int8-activations`, is the exact path. The real SmolLM2 is
served as an AVX2 CPU serves it: a process capped to AVX2 (`RIDGELINE_CPU_ISA=avx2`, a
real build of the kernels, not a mock; ~1 min to compile once).

What must hold: the choice as the flags ask it; the layers' routes and what they hold
(int8 for every call, a Q4_1 layer's levels once as the int8 kernel's pairs); scores
close to the exact run's; and the exact run exact (no int8 anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.cli import build_parser
from gpu.cpu import isa
from gpu.dtypes import int8_activations_asked
from tests.test_cpu_int8_batches import TEXT, perplexity

ROOT = Path(__file__).resolve().parents[1]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HAS_AVX2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() \
    else False


def test_unset_is_on_only_where_auto_serves_float32_on_a_cpu():
    f32, bf16 = torch.float32, torch.bfloat16
    assert int8_activations_asked(None, "auto", f32, CPU) is None  # where the layers can
    assert int8_activations_asked(None, "auto", bf16, CPU) is False
    assert int8_activations_asked(None, "float32", f32, CPU) is False  # asked: exact
    assert int8_activations_asked(None, "auto", f32, CUDA) is False
    assert int8_activations_asked(True, "float32", f32, CPU) is True
    assert int8_activations_asked(False, "auto", f32, CPU) is False


def test_the_flag_has_both_spellings_and_defaults_to_unset():
    parse = build_parser().parse_args
    assert parse(["serve"]).int8_activations is None
    assert parse(["serve", "--int8-activations"]).int8_activations is True
    assert parse(["serve", "--no-int8-activations"]).int8_activations is False


SCRIPT = r"""
import json, sys
from app import LLM, SamplingParams
from gpu.cpu.linear import PackedLinear
text = sys.argv[1]
out = {}
for name, kwargs in (("auto", {}), ("float32", {"dtype": "float32"})):
    llm = LLM(max_model_len=512, **kwargs)
    try:
        runner = llm.engine.worker.wait_ready()
        layers = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        scored = llm.generate([text], SamplingParams(temperature=0, max_tokens=1,
                                                     prompt_logprobs=1), use_tqdm=False)[0]
        out[name] = {
            "dtype": str(runner.dtype),
            "caps": runner.capabilities.isa,
            "routes": sorted({m.plan.route(r).value for m in layers for r in (1, 16, 200)}),
            "pairs_only": [m.dot_pairs is not None and m.quantized.tensors[0].numel() == 0
                           for m in layers if m.quantized is not None
                           and m.quantized.format == "q4_1"],
            "scores": [[p[0], p[2][0][0]] for p in scored.prompt_logprobs[1:]],
        }
    finally:
        llm.shutdown()
print(json.dumps(out))
"""

@pytest.fixture(scope="module")
def runs() -> dict:
    if not HAS_AVX2:
        pytest.skip("the host has no AVX2")
    env = {**os.environ, isa.ENV: "avx2"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, TEXT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_auto_serves_float32_with_int8_in_every_call(runs):
    auto = runs["auto"]
    assert auto["caps"] == "avx2" and auto["dtype"] == "torch.float32"
    assert auto["routes"] == ["blocks_int8"], auto["routes"]
    assert auto["pairs_only"] and all(auto["pairs_only"]), auto["pairs_only"]  # Q4_1 layers


def test_float32_asked_is_exact(runs):
    assert "blocks_int8" not in runs["float32"]["routes"]


def test_int8_scores_close_to_exact(runs):
    """Bounds with room above docs/cpu.md's figures for the 135M model (the most
    sensitive size)."""
    pairs = list(zip(runs["float32"]["scores"], runs["auto"]["scores"], strict=True))
    top1 = sum(a[1] == b[1] for a, b in pairs) / len(pairs)
    deltas = sorted(abs(a[0] - b[0]) for a, b in pairs)
    assert top1 >= 0.9, top1
    assert deltas[len(deltas) // 2] < 0.06
    ratio = perplexity(runs["auto"]["scores"]) / perplexity(runs["float32"]["scores"])
    assert abs(ratio - 1) < 0.06
    assert sum(deltas) > 0  # int8 did run

