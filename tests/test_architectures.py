"""Every supported architecture, proven against HF transformers on a tiny random model.

Each model is built from the architecture's own transformers config class and saved by
transformers' `save_pretrained` (models/tiny.py), so names, fused layouts (Phi-3) and
config keys are HF's own. Ridgeline's greedy token ids must equal transformers' —
offline, offline with chunked prefill and preemption in a tiny pool, and through the
real HTTP server under the same pressure. Prompts run past every sliding window.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from app import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.server_harness import ServerThread, tiny_config

PROMPT_LENGTHS = [1, 5, 17, 30, 45]
NUM_TOKENS = 24
MAX_MODEL_LEN = 80
WINDOW = 16  # shorter than most prompts: the window decides the tokens
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def hf_configs():
    """name -> (transformers config, save_pretrained's max_shard_size)."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    rotary_half = int(64 // 4 * 0.75) // 2  # Phi-3 factors: one per rotated pair
    return {
        "llama3-tied": (LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), None),
        "qwen2-tied": (Qwen2Config(**COMMON, tie_word_embeddings=True), None),
        # Layer 0 full, layers 1-2 sliding; sharded with an index, as big checkpoints are.
        "qwen2-windows-sharded": (Qwen2Config(
            **COMMON, tie_word_embeddings=False, use_sliding_window=True,
            sliding_window=WINDOW, max_window_layers=1), "2MB"),
        "qwen3-tied": (Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True), None),
        "qwen3-bias-yarn": (Qwen3Config(
            **COMMON, head_dim=32, tie_word_embeddings=False, attention_bias=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}), None),
        "mistral": (MistralConfig(**COMMON, sliding_window=WINDOW), None),
        "phi3-longrope": (Phi3Config(
            **COMMON | dict(pad_token_id=None), original_max_position_embeddings=MAX_MODEL_LEN,
            partial_rotary_factor=0.75, sliding_window=WINDOW + 8,
            rope_scaling={"type": "longrope",
                          "short_factor": [1.0 + 0.2 * i for i in range(rotary_half)],
                          "long_factor": [4.0] * rotary_half}), None),
        "phi3-tied": (Phi3Config(**COMMON | dict(pad_token_id=None), tie_word_embeddings=True,
                                 partial_rotary_factor=0.75), None),
    }


ARCHS = ["llama3-tied", "qwen2-tied", "qwen2-windows-sharded", "qwen3-tied", "qwen3-bias-yarn",
         "mistral", "phi3-longrope", "phi3-tied"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir):
    from models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("archs")
    return {name: make_tiny_hf_model(root / name, smollm2_dir, cfg, max_shard_size=shard)
            for name, (cfg, shard) in hf_configs().items()}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(model_dirs, prompts):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in model_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out[name] = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    return out


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
# 20 blocks x 4 = 80 slots for 5 requests wanting up to 69 each: preemption is certain,
# and a 12-token budget prefills the longer prompts in chunks.
PRESSURE = dict(num_blocks=20, block_size=4, max_num_batched_tokens=12)


def test_the_checkpoints_are_what_the_cases_claim(model_dirs):
    from safetensors import safe_open

    from models.weights import safetensors_files

    for name, path in model_dirs.items():
        cfg = json.loads((path / "config.json").read_text())
        names = set()
        for f in safetensors_files(path):
            with safe_open(str(f), framework="pt") as h:
                names |= set(h.keys())
        assert ("lm_head.weight" not in names) == ("tied" in name), name
        assert (path / "model.safetensors.index.json").is_file() == ("sharded" in name)
        if name.startswith("phi3"):
            assert any(n.endswith("self_attn.qkv_proj.weight") for n in names)
        if name.startswith("qwen2"):
            assert any(n.endswith("self_attn.q_proj.bias") for n in names)
        if name.startswith("qwen3"):
            assert any(n.endswith("self_attn.q_norm.weight") for n in names)
            assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_greedy_parity(arch, model_dirs, prompts, expected):
    llm = LLM(str(model_dirs[arch]), dtype="float32", max_model_len=MAX_MODEL_LEN)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected[arch]
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_parity_under_preemption_and_chunked_prefill(arch, model_dirs, prompts,
                                                             expected):
    llm = LLM(str(model_dirs[arch]), dtype="float32", max_model_len=MAX_MODEL_LEN, **PRESSURE)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == expected[arch]
        assert llm.engine.blocks.num_free_blocks == PRESSURE["num_blocks"]
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


async def _generate_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(*(client.post(url + "/generate", json={
            "input_ids": p, "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                "ignore_eos": True}}) for p in prompts))
    return [r.json()["output_ids"] for r in replies]


@pytest.mark.parametrize("arch", ARCHS)
def test_server_greedy_parity_under_pressure(arch, model_dirs, prompts, expected):
    srv = ServerThread(tiny_config(model_dirs[arch], max_model_len=MAX_MODEL_LEN,
                                   **PRESSURE)).start()
    try:
        assert asyncio.run(_generate_all(srv.url, prompts)) == expected[arch]
        assert srv.engine.core.scheduler.num_preemptions > 0
    finally:
        srv.stop()
