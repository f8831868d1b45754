"""Weight loading: GGUF conversion, the model cache, safetensors streaming, the tokenizer.

The converter is checked against transformers' independent GGUF loader on the real
SmolLM2 (same logits), so a wrong name, shape or Q/K permutation cannot pass.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.gguf_convert import convert_gguf_to_hf_dir, undo_qk_permutation
from models.resolve import CACHE_ENV, default_gguf_path, export_model, resolve_model
from models.tokenizer import apply_chat_template
from models.weights import iter_safetensors

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize(("n_head", "n_kv", "head_dim", "hidden"), [(9, 3, 64, 576), (4, 4, 8, 16)])
def test_undo_qk_permutation_inverts_llama_cpp(n_head: int, n_kv: int, head_dim: int, hidden: int):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_head * head_dim, hidden), dtype=np.float32)
    k = rng.standard_normal((n_kv * head_dim, hidden), dtype=np.float32)
    q_gguf, k_gguf = llama_cpp_permute(q, n_head, n_head), llama_cpp_permute(k, n_head, n_kv)
    assert not np.array_equal(q_gguf, q) and not np.array_equal(k_gguf, k)
    assert not np.array_equal(undo_qk_permutation(q, n_head), q)
    np.testing.assert_array_equal(undo_qk_permutation(q_gguf, n_head), q)
    np.testing.assert_array_equal(undo_qk_permutation(k_gguf, n_kv), k)


@pytest.mark.slow
def test_converted_config_matches_smollm2(smollm2_dir: Path):
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.vocab_size) == (100000.0, 1e-5, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)


@pytest.mark.slow
def test_converted_weights_give_transformers_gguf_logits(smollm2_dir: Path, hf_gguf_model,
                                                          smollm2_tokenizer):
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    short_chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = torch.tensor([apply_chat_template(smollm2_tokenizer, short_chat)])
    with torch.no_grad():
        expected, actual = hf_gguf_model(ids).logits, ours(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_iter_safetensors_streams_every_tensor_in_dtype(smollm2_dir: Path):
    tensors = dict(iter_safetensors(smollm2_dir, torch.bfloat16))
    assert len(tensors) == 2 + 30 * 9  # embeddings, final norm, nine per layer; tied head
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_iter_safetensors_reads_sharded_checkpoints(tmp_path: Path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3, dtype=torch.float16)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = dict(iter_safetensors(tmp_path, torch.float32))
    assert got.keys() == {"a", "b"} and got["b"].dtype == torch.float32


def test_iter_safetensors_names_a_truncated_file(tmp_path: Path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors"):
        list(iter_safetensors(tmp_path, torch.float32))


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_tokenizer):
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = apply_chat_template(smollm2_tokenizer, FRANCE)
    assert ids == apply_chat_template(reference, FRANCE)
    assert all(isinstance(i, int) for i in ids)
    assert "<|im_start|>assistant" in smollm2_tokenizer.chat_template
    assert smollm2_tokenizer.eos_token == "<|im_end|>" and smollm2_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_gguf_cut_mid_tensors_raises_value_error_naming_it(tmp_path: Path, monkeypatch):
    data = default_gguf_path().read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: len(data) // 2])  # an interrupted download
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="broken.gguf"):
        resolve_model(broken)  # fails in the reader, before the tokenizer or dequantizing
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir())  # no half-written entry left


def test_gguf_cut_in_header_raises_value_error_and_writes_nothing(tmp_path: Path):
    broken = tmp_path / "broken.gguf"
    with default_gguf_path().open("rb") as f:
        broken.write_bytes(f.read(100))
    with pytest.raises(ValueError, match="broken.gguf"):
        convert_gguf_to_hf_dir(broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_missing_or_incomplete_model_paths(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model(tmp_path)


@pytest.mark.slow
def test_second_resolve_reuses_the_cache(smollm2_dir: Path):
    cached = resolve_model(None)
    mtime = os.stat(cached / "model.safetensors").st_mtime_ns
    start = time.perf_counter()
    assert resolve_model(None) == cached
    assert time.perf_counter() - start < 2
    assert os.stat(cached / "model.safetensors").st_mtime_ns == mtime


@pytest.mark.slow
def test_the_cache_keeps_block_weights_only_as_blocks(smollm2_dir: Path):
    """The conversion writes dense only what has no blocks (SmolLM2: the norms), so the
    cache is about the GGUF's size; a loader still gets every weight, the kept ones
    dequantized from their blocks exactly (the export's dense values), or as meta
    placeholders where it will not read them."""
    cached = resolve_model(None)
    size = sum(p.stat().st_size for p in cached.rglob("*.safetensors"))
    assert size < 1.6 * default_gguf_path().stat().st_size
    with safe_open(str(cached / "model.safetensors"), framework="pt") as f:
        assert all("norm" in name for name in f.keys())
    exported = dict(iter_safetensors(smollm2_dir))
    name = "model.layers.4.mlp.down_proj.weight"
    got = dict(iter_safetensors(cached, placeholders={name}))
    assert got.keys() == exported.keys()
    assert got[name].is_meta and got[name].shape == exported[name].shape
    other = "model.layers.4.mlp.up_proj.weight"
    assert torch.equal(got[other], exported[other])


@pytest.mark.slow
def test_export_model_writes_a_complete_hf_directory(smollm2_dir: Path, tmp_path: Path):
    out = export_model(None, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in resolve_model(None).iterdir())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == 30 * 9 + 2  # every layer's 9 tensors, embedding, norm
    assert resolve_model(out) == out
    with pytest.raises(FileExistsError):
        export_model(None, out)
