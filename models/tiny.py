"""Tiny random-weight models in HF directory form, for tests and benchmarks.

`make_tiny_llama` writes a Llama's tensors directly (no transformers import): the
engine tests' model and `ridgeline bench overhead`'s, whose forward costs next to
nothing. `make_tiny_hf_model` builds any architecture from its own transformers config
class and saves it with transformers' `save_pretrained`: the checkpoint's names,
layouts and config keys are then HF's own, the strongest input for a parity test.

Both borrow the real SmolLM2 tokenizer (so text paths are real); give them its
vocabulary size, but only a few small layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def make_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(v, h, std=1.0), "model.norm.weight": 1 + rnd(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(h),
            p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.q_proj.weight": rnd(q, h, std=0.3),
            p + "self_attn.k_proj.weight": rnd(kv, h, std=0.3),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h, std=0.5)
    save_file(w, str(out_dir / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def make_tiny_hf_model(out_dir: Path, tokenizer_dir: Path, hf_config, seed: int = 0,
                       max_shard_size: str | None = None) -> Path:
    """Save a randomly initialised `AutoModelForCausalLM.from_config(hf_config)` (float32),
    in shards with a `model.safetensors.index.json` when `max_shard_size` is given.

    HF initialises biases to zero and norms to one, which would leave those code paths
    untested; they get random values too. Set `initializer_range` around 0.2 in the
    config for logits decisive enough that float32 rounding never flips a greedy token.
    """
    from transformers import AutoModelForCausalLM  # heavy: only when building one

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g) * 0.1
            if name.endswith(".bias"):
                param.copy_(noise)
            elif "norm" in name:
                param.copy_(1 + noise)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size
                                      else {}))
    for name in TOKENIZER_FILES:
        # transformers wrote the model's own generation_config.json; keep it.
        if (tokenizer_dir / name).exists() and not (out_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
