"""Rotary position embedding and the scaling variants the supported checkpoints use.

Every variant changes only two things: the inverse frequencies and a constant that
multiplies cos and sin (YaRN's and LongRoPE's attention factor). Both are computed
once, here, exactly as transformers computes them, so that cos/sin tables match HF
bit for bit in float32.

- `default`, `linear`, `llama3` (Llama 3.1+), `yarn` (Qwen2.5 / Qwen3 long context):
  static, one table for every position.
- `longrope` (Phi-3 "su"): HF switches, per forward, from the short to the long factors
  once a sequence passes `original_max_position_embeddings`, re-rotating nothing already
  cached. Ridgeline serves such models up to that length with the short factors, which
  is exactly what HF computes there; `ModelConfig.max_context_len` caps the context.
- `dynamic` (NTK by current length) changes with each sequence's length: refused.

`partial_rotary_factor` < 1 (Phi-4-mini) rotates only the first `rotary_dim` of each
head and passes the rest through.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_parameters(
    scaling: dict[str, Any] | None, *, theta: float, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], attention factor) for a rotary dim of `dim`."""
    kind = rope_type(scaling)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(scaling, theta, dim, max_position_embeddings)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position_embeddings / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (1.0 if factor <= 1.0
                                else math.sqrt(1 + math.log(factor) / math.log(original)))
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**exponents), attention_factor
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
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


def _yarn(scaling: dict[str, Any], theta: float, dim: int,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between (HF's formula)."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all
                            else mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it by `factor`
    interpolated, kept = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + kept * extrapolation
    return inv_freq, attention_factor


class Rotary(nn.Module):
    """cos/sin tables in the rotate-half layout HF checkpoints use, one row per position."""

    def __init__(self, scaling: dict[str, Any] | None, *, theta: float, rotary_dim: int,
                 max_position_embeddings: int, max_positions: int):
        super().__init__()
        # Computed on the CPU whatever device is current, and moved by the caller: on the
        # meta device these ops run through torch's reference ops, which import the
        # compiler (~2 s of every start).
        with torch.device("cpu"):
            inv_freq, attention_factor = rope_parameters(
                scaling, theta=theta, dim=rotary_dim,
                max_position_embeddings=max_position_embeddings)
            freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, rotary_dim] for this step's positions; computed once per step."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dims of every head; pass the rest through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
