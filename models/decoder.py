"""The one decoder behind every supported architecture (Llama, Mistral, Qwen2/2.5,
Qwen3, Phi-3): plain model code in the gpt-fast manner.

The architectures differ only in the options `models/config.py` reads for each: a
bias on q/k/v (Qwen2), an RMSNorm on each q and k head (Qwen3), a sliding window per
layer (Mistral, Phi-3, Qwen with `use_sliding_window`), partial rotary and LongRoPE
(Phi-3), tied or untied embeddings. Each appears below as one named attribute and,
in `forward`, one line.

Input is one flat batch of new tokens from many sequences; attention goes through the
per-step context it is handed (the protocol in `models/attention.py`; the model
thread's `StepContext` knows the paged KV pool). Q/K/V and gate/up projections are
fused: fewer, larger matmuls matter on CPU where per-op overhead is the bottleneck.
The steps between matmuls go through `ops` (`models/ops.py`: plain torch, or fused
Triton kernels on CUDA), and the residual stream is carried beside the hidden states
so that each residual add is joined to the norm after it; RoPE is applied by the
attention context when it can fuse it with the KV store (`PagedAttention.rotates`).
Each module states how HF's separate tensors land in its fused ones
(`checkpoint_layout`), so the loader stays generic; Phi-3 ships them fused already.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import PagedAttention
from models.config import ModelConfig
from models.ops import DecoderOps
from models.rope import Rotary, apply_rotary

# HF checkpoint suffix -> (our parameter suffix, first row, rows)
Layout = dict[str, tuple[str, int, int]]


def _fused(target: str, parts: list[tuple[str, int]]) -> Layout:
    """HF's separate `name.weight` / `name.bias` tensors stacked row-wise into `target`."""
    layout, offset = {}, 0
    for name, rows in parts:
        for kind in ("weight", "bias"):
            layout[f"{name}.{kind}"] = (f"{target}.{kind}", offset, rows)
        offset += rows
    return layout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in fp32; one op instead of six per norm.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.sliding_window = sliding_window  # None: every earlier key
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Qwen3: each q and k head is RMS-normalised before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def checkpoint_layout(self) -> Layout:
        return _fused("qkv_proj", [("q_proj", self.q_size), ("k_proj", self.kv_size),
                                   ("v_proj", self.kv_size)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: PagedAttention):
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # RoPE: fused into the KV store where the backend offers it (CUDA); otherwise
        # here, on q and k heads in one go (half the elementwise ops of doing each).
        rotary = rope if ctx.rotates else None
        if rotary is None:
            qk = apply_rotary(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = ctx.attend(self.layer_idx, q, k, v, self.sliding_window, rotary)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: DecoderOps):
        super().__init__()
        self.ops = ops
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                      bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def checkpoint_layout(self) -> Layout:
        inter = self.intermediate_size
        return _fused("gate_up_proj", [("gate_proj", inter), ("up_proj", inter)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding_window: int | None,
                 ops: DecoderOps):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, residual, rope, ctx):
        """`x` is the previous layer's output, not yet added to `residual` (at the first
        layer: the embeddings, and no residual). Returns this layer's pair."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = x, self.ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            x, residual = self.ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn(x, rope, ctx)
        x, residual = self.ops.add_rms_norm(x, residual, norm2.weight, norm2.eps)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None,
                 ops: DecoderOps | None = None):
        """`ops`: the steps between matmuls (plain torch unless the model thread hands
        over fused kernels)."""
        super().__init__()
        self.config = cfg
        self.ops = ops or DecoderOps()
        max_positions = max_positions or cfg.max_context_len
        # Given its weight, the embedding skips its random init: on the meta device that
        # init runs through torch's reference ops, which import the compiler (~2 s of
        # every start); the weights are loaded over it anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        # A window no shorter than the longest sequence never hides a key: drop it.
        windows = [w if w is not None and w < max_positions else None
                   for w in cfg.sliding_windows]
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, w, self.ops)
                                    for i, w in enumerate(windows))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.make_rotary(max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False
        )

    def make_rotary(self, max_positions: int) -> Rotary:
        """The cos/sin tables (buffers: rebuilt after the model is allocated off `meta`)."""
        cfg = self.config
        if max_positions > cfg.max_context_len:
            raise ValueError(f"{cfg.architecture} is served for at most "
                             f"{cfg.context_note}; asked for {max_positions} positions")
        return Rotary(cfg.rope_scaling_dict, theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim,
                      max_position_embeddings=cfg.max_position_embeddings,
                      max_positions=max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedAttention):
        """[T] token ids and positions → [T, hidden] final hidden states."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        fused = self.ops.decode_layers(self, x, rope, ctx)
        if fused is not None:  # the same kernels in one call, no Python between them
            return fused
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """The LM head's output, widened to float32 unless `widen` is off (the sampler
        widens what it needs: an argmax reads a bf16 row as it is)."""
        logits = (F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None  # tied
                  else self.lm_head(hidden))
        return logits.float() if widen else logits

    # -- weights ------------------------------------------------------------------

    def checkpoint_layout(self) -> Layout:
        """Every fused parameter's HF sources: HF name (without `model.`) -> (our
        parameter, first row, rows). Parameters not listed take their HF tensor whole."""
        return {
            f"{prefix}.{hf}": (f"{prefix}.{ours}", offset, rows)
            for prefix, module in self.named_modules()
            if prefix and hasattr(module, "checkpoint_layout")
            for hf, (ours, offset, rows) in module.checkpoint_layout().items()
        }

    def checkpoint_names(self, params: Collection[str]) -> set[str]:
        """The HF names of the tensors that fill our `params` (a fused one's parts)."""
        layout = self.checkpoint_layout()
        fused = {ours for ours, _, _ in layout.values()}
        names = {hf for hf, (ours, _, _) in layout.items() if ours in params}
        names |= {p for p in params if p not in fused}
        return {n if n.startswith("lm_head") else f"model.{n}" for n in names}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Collection[str] = ()) -> None:
        """Load HF-named tensors into their (fused) parameters; every row must be set.

        `skip`: parameters left unset (their tensors checked but not copied) for a caller
        that builds those layers from other sources and replaces them before the model
        runs (`gpu.cpu.packing.params_not_needed`)."""
        params = dict(self.named_parameters())
        layout = self.checkpoint_layout()
        loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, offset, rows = layout.get(name, (name, 0, None))
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
            param = params[target]
            dst = param.data if rows is None else param.data[offset : offset + rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            if target not in skip:
                dst.copy_(tensor)  # converts to the parameter's dtype as it copies
            loaded[target] = loaded.get(target, 0) + tensor.shape[0]
        missing = [n for n, p in params.items() if loaded.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:5]}")
