"""CLI flags: vLLM names, SGLang aliases, and their path into the engine config."""

import pytest

from app.cli import build_parser, engine_config_from_args


def test_vllm_flags_reach_the_engine_config():
    a = build_parser().parse_args([
        "serve", "--max-num-seqs", "7", "--max-num-batched-tokens", "99", "--block-size", "8",
        "--kv-cache-memory", "2GiB", "--gpu-memory-utilization", "0.5", "--max-model-len", "512",
        "--max-queued-requests", "3", "--preemption-policy", "length", "--dtype", "bfloat16",
    ])
    c = engine_config_from_args(a)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (7, 99)
    assert (c.cache.block_size, c.cache.kv_cache_memory) == (8, 2 * 1024**3)
    assert c.cache.gpu_memory_utilization == 0.5 and c.max_model_len == 512
    assert c.scheduler.max_queued_requests == 3 and c.scheduler.preemption_policy == "length"
    assert c.dtype == "bfloat16"


def test_sglang_aliases():
    a = build_parser().parse_args(["serve", "--max-running-requests", "5",
                                   "--mem-fraction-static", "0.7"])
    c = engine_config_from_args(a)
    assert c.scheduler.max_num_seqs == 5 and c.cache.gpu_memory_utilization == 0.7


def test_defaults_serve_the_embedded_model_on_loopback():
    a = build_parser().parse_args(["serve"])
    assert (a.host, a.port, a.model) == ("127.0.0.1", 8000, None)


@pytest.mark.parametrize("flags,match", [
    (["--block-size", "12"], "block_size"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--kv-cache-memory", "lots"], "byte size"),
])
def test_bad_values_fail_at_start_naming_the_value(flags, match):
    with pytest.raises(ValueError, match=match):
        engine_config_from_args(build_parser().parse_args(["serve", *flags]))
