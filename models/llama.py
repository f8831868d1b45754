"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window).

Plain model code in the gpt-fast manner. Input is one flat batch of new tokens
from many sequences; attention goes through the per-step context it is handed
(the protocol in `models/attention.py`; the model thread's `StepContext` knows
the paged KV pool). Q/K/V and gate/up projections are fused at load time: fewer,
larger matmuls matter on CPU where per-op overhead is the bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import PagedAttention
from models.config import LlamaConfig


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 / linear scaling applied when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept; smooth in between.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, smoothed, scaled)
    if kind == "default":
        return inv_freq
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class Rotary(nn.Module):
    """Rotary embedding in the rotate-half layout HF checkpoints use."""

    def __init__(self, cfg: LlamaConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions).float(), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, D] for this step's positions; computed once, used by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in fp32; one op instead of six per norm.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: PagedAttention):
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # Rotate q and k heads in one go: half the elementwise ops of doing each.
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, ctx):
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedAttention):
        """[T] token ids and positions → [T, hidden] final hidden states."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # -- weights ------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {  # HF suffix -> (our suffix, row offset, rows)
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, inter),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", inter, inter),
        }
        loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, offset, rows = name, 0, None
            for suffix, (ours, off, n) in fused.items():
                if name.endswith(suffix):
                    target, offset, rows = name[: -len(suffix)] + ours, off, n
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {cfg.architecture}")
            param = params[target]
            dst = param.data if rows is None else param.data[offset : offset + rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + tensor.shape[0]
        missing = [n for n, p in params.items() if loaded.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:5]}")
