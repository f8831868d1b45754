"""The roofline arithmetic against hand-computed figures, the peaks measurement, the live
position, the stats line, and `ridgeline plan` (no device, no server)."""

from __future__ import annotations

import json

import pytest
import torch

from app.cli import main
from app.engine.outputs import StepStats
from app.engine.roofline import PhaseTotals, RooflineTracker, position
from app.engine.stats_logger import format_roofline
from gpu.peaks import measure_peaks
from gpu.roofline import DevicePeaks, ModelCost, StepCost, attention_work
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM


@pytest.fixture(scope="module")
def tiny_cfg(tiny_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def smollm2_cfg(smollm2_dir) -> ModelConfig:
    return ModelConfig.from_dir(smollm2_dir)


def test_tiny_model_cost_by_hand(tiny_cfg):
    """hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads x 16, vocab 49152,
    untied, float32."""
    cost = ModelCost.from_config(tiny_cfg, 4)
    per_layer = 64 * (64 + 32 + 32) + 64 * 64 + 3 * 64 * 128  # qkv, o, gate/up/down = 36864
    assert cost.matmul_params == 2 * per_layer == 73728
    assert cost.layer_params == 2 * (per_layer + 2 * 64) + 64 == 74048  # + norms, final norm
    assert cost.head_params == 49152 * 64 == 3145728
    assert cost.total_params == 74048 + 2 * 3145728 == 6365504  # embedding and lm_head
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert cost.attention_flops_per_pair == 4 * 4 * 16 * 2 == 512
    # Decode, two sequences at contexts 10 and 20, both sampled.
    step = cost.step([1, 1], [10, 20], logit_rows=2)
    assert step.flops == 2 * 73728 * 2 + 2 * 3145728 * 2 + 512 * 30 == 12893184
    assert step.bytes_read == (74048 + 3145728 + 2 * 64) * 4 + 30 * 512 == 12894976
    assert step.bytes_written == 2 * 512
    # A prefill chunk that samples nothing does not read the LM head.
    chunk = cost.step([5], [8], logit_rows=0)
    assert chunk.flops == 2 * 73728 * 5 + 512 * (4 + 5 + 6 + 7 + 8)
    assert chunk.bytes_read == (74048 + 5 * 64) * 4 + 8 * 512


def test_smollm2_cost_by_hand(smollm2_cfg):
    """hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads x 64, vocab 49152,
    tied, bfloat16: 134,515,008 parameters (SmolLM2-135M's published count)."""
    cost = ModelCost.from_config(smollm2_cfg, 2)
    assert cost.matmul_params == 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536) == 106168320
    assert cost.total_params == 134515008
    assert cost.weights_bytes == 269030016
    assert cost.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    # Decode at batch 64, each sequence at context 2048.
    step = cost.decode(64, 2048)
    flops = 2 * 106168320 * 64 + 2 * 28311552 * 64 + 4 * 9 * 64 * 30 * 64 * 2048
    assert step.flops == flops == 26273120256
    assert step.bytes_read == (134515008 + 64 * 576) * 2 + 64 * 2048 * 23040 == 3289002624
    assert step.bytes_written == 64 * 23040
    assert step.intensity == pytest.approx(7.985, abs=1e-3)
    # Decode at batch B without context does ~B FLOPs per byte of bf16 weights.
    for batch in (1, 8, 64):
        assert cost.decode(batch, 1).intensity == pytest.approx(batch, rel=0.02)


@pytest.mark.parametrize("fixture", ["tiny_cfg", "smollm2_cfg"])
def test_parameter_count_matches_the_decoder(fixture, request):
    cfg = request.getfixturevalue(fixture)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=64)
    assert ModelCost.from_config(cfg, 4).total_params == sum(
        p.numel() for p in model.parameters())


@pytest.mark.parametrize(("q", "end", "window", "pairs", "keys"), [
    (1, 8, None, 8, 8),  # a decode sees its whole context
    (5, 8, None, 4 + 5 + 6 + 7 + 8, 8),  # a chunk: a causal ramp
    (1, 8, 6, 6, 6),
    (5, 8, 4, 4 * 5, 8),  # every query already past the window
    (5, 8, 6, 4 + 5 + 6 + 6 + 6, 8),  # the chunk crosses the window
    (3, 20, 6, 18, 8),  # a late chunk reads W + q - 1 keys
    (5, 5, 8, 15, 5),  # the window is longer than the sequence
])
def test_attention_work(q, end, window, pairs, keys):
    brute = sum(min(p + 1, window or p + 1) for p in range(end - q, end))
    assert brute == pairs
    assert attention_work([q], [end], window) == (pairs, keys)


def test_peaks_arithmetic():
    peaks = DevicePeaks(1e9, 1e10, "test", "float32", "given")
    cost = StepCost(flops=2 * 10**9, bytes_read=10**9, bytes_written=0, seconds=2.0)
    assert peaks.ridge == 10
    assert peaks.mbu(cost) == pytest.approx(0.5)
    assert peaks.mfu(cost) == pytest.approx(0.1)
    assert peaks.floor_seconds(cost) == pytest.approx(1.0)  # memory-bound: 1e9 B at 1e9 B/s
    assert peaks.mbu(StepCost(1, 1, 0)) == 0.0  # no time measured: no claim


def test_peaks_are_measured_once_per_process():
    t0 = measure_peaks(torch.device("cpu"), torch.float32, 1 << 20)
    assert 1e8 < t0.bandwidth < 1e13 and 1e8 < t0.flops < 1e14
    assert "measured" in t0.how and t0.dtype == "float32"
    assert measure_peaks(torch.device("cpu"), torch.float32) is t0


def _stats(prompt: int, gen: int, seconds: float, flops: int, read: int) -> StepStats:
    return StepStats(prompt_tokens=prompt, generation_tokens=gen, model_seconds=seconds,
                     flops=flops, bytes_read=read, bytes_written=0)


def test_live_position_is_time_weighted():
    peaks = DevicePeaks(1e9, 1e10, "test", "float32", "given")
    tracker = RooflineTracker(peaks)
    assert tracker.record(StepStats()) is None  # an idle step did not run the model
    pos = tracker.record(_stats(0, 8, 0.5, 10**9, 4 * 10**8))
    assert not pos.prefill and pos.mbu == pytest.approx(0.8) and pos.intensity == 2.5
    tracker.record(_stats(0, 8, 1.5, 10**9, 4 * 10**8))
    tracker.record(_stats(100, 1, 1.0, 5 * 10**9, 10**8))
    snap = tracker.snapshot()
    decode = snap["since_start"]["decode"]
    assert decode["steps"] == 2 and decode["mbu"] == pytest.approx(0.4)  # 0.8 GB in 2 s
    assert snap["recent"]["prefill"]["mfu"] == pytest.approx(0.5)
    assert snap["last_step"]["decode"]["mbu"] == pytest.approx(8e8 / 1.5 / 1e9 / 2, rel=1e-3)
    assert position(_stats(0, 1, 1.0, 1, 1), None) is None  # peaks unknown


def test_a_step_past_the_measured_peak_raises_it():
    """A copy measured low (a busy host) or a step served from cache: the step's rate
    becomes the peak, so no utilisation passes 100 % in the positions, the snapshot and
    the stats line, and the peaks say they were raised."""
    peaks = DevicePeaks(1e9, 1e10, "test", "float32", "measured")
    tracker = RooflineTracker(peaks)
    pos = tracker.record(_stats(0, 8, 0.5, 10**9, 10**9))  # 2 GB/s against 1 GB/s
    assert pos.mbu == pytest.approx(1.0) and tracker.peaks.bandwidth == pytest.approx(2e9)
    assert tracker.peaks.flops == 1e10 and tracker.peaks.how.endswith("a step achieved")
    assert tracker.record(_stats(0, 8, 1.0, 10**9, 10**9)).mbu == pytest.approx(0.5)
    decode = tracker.snapshot()["since_start"]["decode"]
    assert decode["mbu"] <= 1.0
    line = format_roofline(tracker.total["decode"], PhaseTotals(), tracker.peaks)
    assert "Decode MBU: 66.7%" in line  # 2 GB in 1.5 s against 2 GB/s
    assert tracker.peaks.raised_to(1.0, 1.0) is tracker.peaks
    again = tracker.peaks.raised_to(4e9, 0.0)
    assert again.how.count("raised") == 1 and again.bandwidth == 4e9


def test_stats_line_gains_the_roofline():
    peaks = DevicePeaks(1e9, 1e10, "test", "float32", "given")
    decode, prefill = PhaseTotals(), PhaseTotals()
    assert format_roofline(decode, prefill, peaks) == ""
    decode.add(_stats(0, 8, 1.0, 10**9, 5 * 10**8))
    line = format_roofline(decode, prefill, peaks)
    assert line == ", Decode MBU: 50.0% (at 2.0 FLOP/B), ridge 10.0 FLOP/B"
    prefill.add(_stats(64, 1, 1.0, 4 * 10**9, 10**8))
    assert "Prefill MFU: 40.0% (at 40.0 FLOP/B)" in format_roofline(decode, prefill, peaks)
    # Past the ridge decode is compute-bound: its MFU is shown too (and MBU for a short
    # prefill below it).
    decode.add(_stats(0, 64, 1.0, 3 * 10**10, 10**8))
    assert "Decode MBU: 30.0% (MFU 155.0% at 51.7 FLOP/B)" in format_roofline(
        decode, prefill, peaks)
    short = PhaseTotals()
    short.add(_stats(4, 1, 1.0, 10**9, 10**9))
    assert "Prefill MFU: 10.0% (MBU 100.0% at 1.0 FLOP/B)" in format_roofline(
        PhaseTotals(), short, peaks)


def test_engine_steps_carry_their_cost(tiny_dir):
    from app.engine.core import EngineCore
    from app.engine.sampling_params import SamplingParams
    from tests.server_harness import tiny_config

    core = EngineCore(tiny_config(tiny_dir))
    try:
        core.add_request("a", list(range(100, 105)), SamplingParams(max_tokens=2))
        first = core.step().stats  # the 5-token prompt in one chunk, sampled
        expected = core.cost.step([5], [5], 1)
        assert (first.flops, first.bytes_read, first.bytes_written) == (
            expected.flops, expected.bytes_read, expected.bytes_written)
        assert first.model_seconds > 0 and first.prompt_tokens == 5
        second = core.step().stats  # one decode at context 6
        assert second.flops == core.cost.step([1], [6], 1).flops and second.prompt_tokens == 0
        assert core.peaks is not None and core.peaks.bandwidth > 0
    finally:
        core.shutdown()


def test_plan_command_without_a_device(tiny_dir, capsys):
    """`ridgeline plan` answers the memory questions from config.json and the settings."""
    assert main(["plan", "--model", str(tiny_dir), "--dtype", "float32", "--max-model-len",
                 "256", "--kv-cache-memory", "64MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mem = report["memory"]
    assert mem["kv_bytes_per_token"] == 512 and mem["weights_bytes"] == 6365504 * 4
    assert mem["kv_cache_tokens"] == (64 << 20) // 512
    assert mem["num_blocks"] == (64 << 20) // 512 // 16
    assert mem["max_concurrency"] == pytest.approx(mem["kv_cache_tokens"] / 256, abs=0.01)
    assert report["peaks"] is None and "bound" not in report["roofline"]["steps"][0]
    # A GPU that is not here: its memory and its data-sheet peaks, given.
    assert main(["plan", "--model", str(tiny_dir), "--max-model-len", "256",
                 "--device-memory", "80GiB", "--gpu-memory-utilization", "0.5",
                 "--peak-bandwidth-gbps", "3350", "--peak-tflops", "989"]) == 0
    text = capsys.readouterr().out
    assert "bfloat16 on cuda" in text and "KV cache size:" in text
    assert "Available KV cache memory: 39.99 GiB" in text  # 80 x 0.5 - 0.012 GiB of weights
    assert "decode batch 1 " in text and "memory-bound" in text and "ridge at 295.2" in text
    assert "upper bound" in text
