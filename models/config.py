"""A checkpoint's hyper-parameters, read from its HF `config.json`, for the one decoder.

Llama, Mistral, Qwen2/2.5, Qwen3 and Phi-3 are the same decoder (pre-norm, RMSNorm,
rotary attention with GQA, SwiGLU MLP). What differs is a handful of named options,
and each architecture's reader below says which of them it sets, as transformers'
own modeling file for it does:

| architecture | options |
| --- | --- |
| `LlamaForCausalLM` | `attention_bias` (q/k/v/o), `mlp_bias`; Llama 3.x rope |
| `MistralForCausalLM` | one `sliding_window` for every layer |
| `Qwen2ForCausalLM` | bias on q/k/v; windows (`use_sliding_window`, `max_window_layers`) |
| `Qwen3ForCausalLM` | RMSNorm per q/k head (`qk_norm`); `attention_bias`; windows as Qwen2 |
| `Phi3ForCausalLM` | fused weights; `partial_rotary_factor`; LongRoPE; one `sliding_window` |

Anything the decoder cannot compute exactly as HF does is refused here, at start, with
the reason, rather than served as wrong tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.rope import ROPE_TYPES, rope_type


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False  # q, k and v projections carry a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE
    # Per layer: a query at position p sees keys p - window + 1 .. p; None = every key.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for "
                             f"{self.num_layers} layers")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of "
                             f"head_dim={self.head_dim} is not an even rotary dimension")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one: only then can a request's KV
        blocks that fall out of it be freed (full-attention layers still read them)."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def max_context_len(self) -> int:
        """The longest sequence this model is served for (see `context_note`)."""
        scaling = self.rope_scaling_dict or {}
        kind = rope_type(scaling)
        if kind == "longrope":
            return min(self.max_position_embeddings, scaling["original_max_position_embeddings"])
        if kind == "yarn" and scaling.get("factor") and scaling.get(
                "original_max_position_embeddings"):
            # YaRN is static: the context it was scaled for is original x factor.
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * scaling["factor"]))
        return self.max_position_embeddings

    @property
    def context_note(self) -> str:
        """`max_context_len` and where it comes from, for errors and the start-up log."""
        n, kind = self.max_context_len, rope_type(self.rope_scaling_dict)
        if kind == "longrope" and n < self.max_position_embeddings:
            return (f"{n} tokens (original_max_position_embeddings={n}: past it HF switches "
                    "each sequence to LongRoPE's long factors, which Ridgeline does not "
                    f"serve, though max_position_embeddings={self.max_position_embeddings})")
        if n > self.max_position_embeddings:
            return (f"{n} tokens (original_max_position_embeddings x the YaRN factor; "
                    f"max_position_embeddings={self.max_position_embeddings})")
        return f"{n} tokens (max_position_embeddings={n})"

    def describe(self) -> str:
        """One line for the start-up log: what was loaded, in the terms of its config."""
        parts = [f"{self.num_layers} layers", f"hidden {self.hidden_size}",
                 f"{self.num_heads} heads / {self.num_kv_heads} KV heads x {self.head_dim}",
                 f"vocab {self.vocab_size}",
                 "tied embeddings" if self.tie_word_embeddings else "untied embeddings"]
        if rope_type(self.rope_scaling_dict) != "default":
            parts.append(f"rope {rope_type(self.rope_scaling_dict)}")
        if self.partial_rotary_factor != 1.0:
            parts.append(f"rotary dim {self.rotary_dim}")
        if self.attention_bias:
            parts.append("q/k/v bias")
        if self.qk_norm:
            parts.append("q/k norm")
        windowed = [w for w in self.sliding_windows if w is not None]
        if windowed:
            parts.append(f"sliding window {windowed[0]} on {len(windowed)}/{self.num_layers} "
                         "layers")
        return f"{self.architecture} ({', '.join(parts)})"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        reader = ARCHITECTURES.get(arch)
        if reader is None:
            raise ValueError(f"unsupported architecture {arch!r}; Ridgeline serves "
                             f"{', '.join(ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act={cfg['hidden_act']!r} is not supported "
                             "(the decoder's MLP is SwiGLU)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
        common = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(cfg, arch),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor")
                                        or rope.get("partial_rotary_factor") or 1.0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )
        return cls(**(common | reader(cfg)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: 2 · layers · kv_heads · head_dim · dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope_scaling(cfg: dict[str, Any], arch: str) -> tuple[tuple[str, Any], ...] | None:
    """The scaling dict, from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and isinstance(cfg.get("rope_parameters"), dict):
        scaling = cfg["rope_parameters"]
    if not scaling or rope_type(scaling) == "default":
        return None
    scaling = dict(scaling)
    kind = rope_type(scaling)
    if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's own renaming of its older spellings
    if kind not in ROPE_TYPES:
        raise ValueError(f"{arch}: rope scaling {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)}); 'dynamic' changes the frequencies with "
                         "each sequence's length")
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    if kind in ("llama3", "yarn", "longrope"):
        # As transformers resolves it: a top-level value (Phi-3 keeps one, default 4096)
        # wins over the dict's own, which defaults to max_position_embeddings.
        top = cfg.get("original_max_position_embeddings")
        if top is None and arch == "Phi3ForCausalLM":
            top = 4096
        scaling["original_max_position_embeddings"] = (
            top or scaling.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings"))
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


# -- per-architecture options ---------------------------------------------------------


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _one_window(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mistral and Phi-3: `sliding_window` (when set) applies to every layer."""
    window = cfg.get("sliding_window")
    return dict(sliding_windows=(window or None,) * cfg["num_hidden_layers"])


def _qwen_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """HF Qwen2/Qwen3: without `use_sliding_window` there is no window at all; with it,
    `layer_types` says which layers slide, else layers >= `max_window_layers` do."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if not window:
        return (None,) * layers
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)
    ]
    return tuple(window if t == "sliding_attention" else None for t in types)


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(attention_bias=True, sliding_windows=_qwen_windows(cfg))


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True,
                head_dim=cfg.get("head_dim") or 128,  # Qwen3Config's default
                sliding_windows=_qwen_windows(cfg))


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _one_window,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _one_window,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
