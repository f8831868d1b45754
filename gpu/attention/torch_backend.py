"""Paged attention in plain torch: the CPU path and the reference for the kernels.

The pool layout is head-major, `[num_kv_heads, num_slots, head_dim]` per layer,
chosen for CPU: one `index_select` of whole blocks (viewed as
`[kv_heads, num_blocks, block_size * head_dim]`) gathers a sequence group's keys
straight into `[kv_heads, B, L, D]`, which batched matmuls take without another
copy, where a token-major pool needs a transpose per gather, and whole blocks are
one contiguous read each where single slots are one each.

Sequences are split into two groups: decode rows (one new token each) and
prefill rows (several new tokens).
- Storing: with the C++ kernels, RoPE is applied on the way into the pool (q rotated
  in place), one pass per token (`fuses_rotary`); else the model rotates and two
  index_copy_ calls store.
- Decode rows: when the C++ CPU kernels are built (`gpu/cpu/kernels/`, given as
  `kernels`), one call reads the pool in place, walking each row's block table: the
  gather below copies every context's K/V once per layer, and that copy dominates a
  step at long contexts. Otherwise two batched matmuls with the query heads of each
  KV head stacked (GQA without repeating K/V); CPU SDPA is slow for one query token.
  Decode rows of a bf16 model whose block tables start with the same blocks (a shared
  system prompt under prefix caching) take cascade attention on a CPU with AMX
  (`cascade_decode_amx.cpp`): the shared blocks once for all of them on the tile unit,
  each row's own keys after them, merged exactly; found once per step in `prepare()`
  (`shared_prefix.py`), not where a sliding window applies.
- Prefill rows: with the C++ kernels, one call reads the pool in place too
  (`paged_prefill.cpp`): after a cached prefix the new tokens are few and the keys many,
  and the gather and masked SDPA below copy every cached key and value of the group once
  per layer (`benchmarks/cpu_decode_ab.py` times both paths); a bf16 model takes
  `paged_prefill_bf16.cpp`, the same call with bf16 products: on the tile unit where the
  CPU has AMX, else by AVX512-BF16 dot products (`benchmarks/cpu_prefill_ab.py`). Otherwise
  scaled_dot_product_attention with a mask that is causal within the new tokens and
  hides the padding.
Index and mask tensors are built once per step in `prepare()`; a sliding window's
mask once per step and window, on first use.

With a sliding window the gathers still take the whole block table (keys out of the
window are masked, never used): a block freed once it left every window may hold
another request's keys by then, so its table entry only has to be a valid block id.
The C++ decode kernel reads only the window's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, AttentionInputs
from gpu.attention.shared_prefix import SharedPrefix, find_shared_prefix
from gpu.cpu.capabilities import CpuCapabilities
from models.rope import apply_rotary


@dataclass
class _Group:
    query_rows: torch.Tensor  # [B, Q] rows of the flat token batch (padding repeats a row)
    key_blocks: torch.Tensor  # [B * L / block_size] pool blocks (padding: any valid block)
    allowed: torch.Tensor  # [B, Q, L] bool: causal within the new tokens, hides padding
    query_pos: torch.Tensor  # [B, Q] position of each new token
    out_rows: torch.Tensor  # [N] rows of the flat output these results fill
    valid: torch.Tensor  # [B, Q] which query entries are real
    num_seqs: int
    max_query_len: int
    max_context_len: int  # L: the longest context, rounded up to whole blocks
    identity: bool  # the group is every row of the batch, in order, one token each
    block_tables: torch.Tensor  # [B, blocks] int32, the group's rows (for the C++ kernels)
    context_lens: torch.Tensor  # [B] int32
    query_starts: torch.Tensor  # [B] int32: each sequence's first row in the step
    query_lens: torch.Tensor  # [B] int32
    shared: SharedPrefix | None = None  # decode rows sharing a prefix of blocks
    _bias: dict[tuple[torch.dtype, int | None], torch.Tensor] = field(default_factory=dict)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def allowed_in(self, window: int | None) -> torch.Tensor:
        """`allowed`, further limited to keys > position - window (HF's sliding mask)."""
        if window is None:
            return self.allowed
        if window not in self._windowed:
            pos = torch.arange(self.max_context_len, device=self.allowed.device)
            recent = pos[None, None, :] > self.query_pos[:, :, None] - window
            self._windowed[window] = self.allowed & recent
        return self._windowed[window]

    def decode_bias(self, dtype: torch.dtype, num_kv_heads: int,
                    window: int | None = None) -> torch.Tensor:
        """Additive mask [KVH*B, 1, L] for decode, made once per step, dtype and window."""
        if (dtype, window) not in self._bias:
            allowed = self.allowed_in(window)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))  # [B, 1, L]
            self._bias[dtype, window] = bias.repeat(num_kv_heads, 1, 1)
        return self._bias[dtype, window]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]
    num_tokens: int


class TorchAttentionBackend(AttentionBackend):
    # dtypes the C++ decode kernel takes; others keep the torch path
    KERNEL_DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 kernels=None):
        """`kernels`: the runner's `CpuCapabilities`, the library's ops, or None."""
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        capabilities = CpuCapabilities.of(kernels)
        # torch.ops.ridgeline_cpu, or None: plain torch throughout
        self.kernels = capabilities.kernels if capabilities.has("paged_decode") else None
        # RoPE joined to the KV store in one C++ pass per token (rotary_kv_store.cpp).
        self.fuses_rotary = capabilities.has("rotary_kv_store_")
        self.prefills_in_place = capabilities.has("paged_prefill_")
        # A bf16 model's prefill with bf16 products (paged_prefill_bf16.cpp): on the tile
        # unit where the CPU has AMX, else by AVX512-BF16 dot products; None: fp32 FMAs.
        self.bf16_prefill = None
        if self.kernels is not None and head_dim % 32 == 0:
            for op, usable in (("paged_prefill_amx_", capabilities.amx),
                               ("paged_prefill_bf16_", True)):
                if usable and capabilities.has(op):
                    self.bf16_prefill = getattr(self.kernels, op)
                    break
        # bf16 decode rows sharing a prefix of blocks: cascade attention on the tile unit.
        self.cascade_built = (capabilities.amx and capabilities.has("cascade_decode_amx_")
                              and head_dim % 32 == 0)
        self.cascades = self.cascade_built  # tests and benchmarks compare with it off
        self._constants: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        self._arange: dict[torch.device, torch.Tensor] = {}

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks * self.block_size, self.head_dim)

    def prepare(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        qlens = inputs.query_lens_list
        if inputs.max_query_len == 1:  # every row decodes: one group, the batch in order
            return TorchAttentionMetadata(inputs.slot_mapping, [self._decode_all(inputs)],
                                          len(qlens))
        decode = [i for i, q in enumerate(qlens) if q == 1]
        prefill = [i for i, q in enumerate(qlens) if q != 1]
        groups = [self._group(inputs, idx) for idx in (decode, prefill) if idx]
        return TorchAttentionMetadata(inputs.slot_mapping, groups, sum(qlens))

    def _group(self, inputs: AttentionInputs, seqs: list[int]) -> _Group:
        device = inputs.slot_mapping.device
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        starts = inputs.query_start_loc[idx].long()
        qlens = (inputs.query_start_loc[idx + 1] - inputs.query_start_loc[idx]).long()
        ctx = inputs.context_lens[idx].long()
        q_max = max(inputs.query_lens_list[i] for i in seqs)
        num_blocks = -(-max(inputs.context_lens_list[i] for i in seqs) // self.block_size)
        l_max = num_blocks * self.block_size  # whole blocks; the mask hides the tail

        j = torch.arange(q_max, device=device)
        valid = j[None, :] < qlens[:, None]  # [B, Q]
        query_rows = starts[:, None] + torch.minimum(j[None, :], qlens[:, None] - 1)
        query_pos = (ctx - qlens)[:, None] + j[None, :]  # position of each new token

        pos = torch.arange(l_max, device=device)
        key_blocks = inputs.block_tables[idx, :num_blocks].long()

        # Causal: the new token at position p sees keys 0..p (all inside its context).
        allowed = pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
        identity = q_max == 1 and len(seqs) == len(inputs.query_lens_list)
        tables = inputs.block_tables[idx, :num_blocks].to(torch.int32).contiguous()
        shared = None
        if self.cascades and q_max == 1:
            shared = find_shared_prefix(tables, [inputs.context_lens_list[i] for i in seqs],
                                        self.block_size)
        return _Group(query_rows, key_blocks.flatten(), allowed, query_pos, query_rows[valid],
                      valid, len(seqs), q_max, l_max, identity, tables,
                      inputs.context_lens[idx].to(torch.int32).contiguous(),
                      starts.to(torch.int32), qlens.to(torch.int32), shared)

    def one_call_decode(self, meta: TorchAttentionMetadata) -> tuple | None:
        """(slot_mapping, block_tables, context_lens, then the shared prefix's rows, tokens,
        others, other_tables and other_lens: None, 0 and Nones where no rows share one)
        where the step is one group of every row, one token each, and `forward` would take
        only the C++ paths (RoPE fused with the store, `paged_decode`, `_cascade`):
        `gpu/cpu/layer_call.py` then runs the layers in one call with them. Its caller
        takes only bf16 pools and models without a sliding window, where `_decode` takes
        `_cascade` whenever the step has a shared prefix."""
        if self.kernels is None or not self.fuses_rotary or len(meta.groups) != 1:
            return None
        g = meta.groups[0]
        if not g.identity:
            return None
        s = g.shared
        if s is None:
            return meta.slot_mapping, g.block_tables, g.context_lens, None, 0, None, None, None
        return (meta.slot_mapping, g.block_tables, g.context_lens, s.rows, s.tokens, s.others,
                s.other_tables, s.other_lens)

    def _decode_all(self, inputs: AttentionInputs) -> _Group:
        """`_group` of a decode-only batch, every row in order, with fewer ops: no row
        index to gather through, the step's own context lengths and tables (already
        int32, contiguous) where they are whole, and the index constants made once per
        batch size. The same fields and values as `_group` gives."""
        b = len(inputs.query_lens_list)
        rows, rows32, ones32, valid = self._row_constants(b, inputs.slot_mapping.device)
        num_blocks = -(-inputs.max_context_len // self.block_size)
        l_max = num_blocks * self.block_size
        ctx = inputs.context_lens
        query_pos = (ctx - 1).long()[:, None]
        allowed = self._positions(l_max, ctx.device)[None, None, :] <= query_pos[:, :, None]
        tables = inputs.block_tables
        if tables.shape[1] != num_blocks or tables.dtype != torch.int32:
            tables = tables[:, :num_blocks].to(torch.int32)
        tables = tables.contiguous()
        if ctx.dtype != torch.int32:
            ctx = ctx.to(torch.int32)
        shared = None
        if self.cascades:
            shared = find_shared_prefix(tables, inputs.context_lens_list, self.block_size)
        return _Group(rows[:, None], tables.flatten().long(), allowed, query_pos, rows, valid,
                      b, 1, l_max, True, tables, ctx.contiguous(), rows32, ones32, shared)

    def _row_constants(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Row indices (int64, int32), ones (int32) and an all-true [b, 1] mask for a
        batch of `b`: never written, so shared by every step of that size."""
        key = (b, device)
        if key not in self._constants:
            rows = torch.arange(b, device=device)
            self._constants[key] = (rows, rows.to(torch.int32),
                                    torch.ones(b, dtype=torch.int32, device=device),
                                    torch.ones(b, 1, dtype=torch.bool, device=device))
        return self._constants[key]

    def _positions(self, length: int, device: torch.device) -> torch.Tensor:
        """`arange(length)` as a slice of one kept tensor, grown when a step needs more."""
        kept = self._arange.get(device)
        if kept is None or kept.numel() < length:
            kept = self._arange[device] = torch.arange(max(length, 2 * (0 if kept is None
                                                                        else kept.numel())),
                                                       device=device)
        return kept[:length]

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata,
                sliding_window: int | None = None, rotary=None):
        # The CPU path never pads, so every slot is a real one (-1 never occurs here).
        if rotary is not None and q.dtype in self.KERNEL_DTYPES:  # q rotated in place
            self.kernels.rotary_kv_store_(q, k, v, *rotary, k_cache, v_cache,
                                          meta.slot_mapping)
        else:
            if rotary is not None:  # a dtype the kernel does not take
                q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
            # A bfloat16 pool under float32 (--kv-cache-dtype) rounds each value here.
            k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
            v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))

        out = None if len(meta.groups) == 1 and meta.groups[0].identity else torch.empty_like(q)
        by_block = (self.num_kv_heads, -1, self.block_size * self.head_dim)
        for g in meta.groups:
            if g.max_query_len == 1:
                o = self._decode(q if g.identity else q[g.query_rows[:, 0]], k_cache, v_cache,
                                 g, sliding_window)
            elif self.prefills_in_place and q.dtype in self.KERNEL_DTYPES:
                # Reads the pool in place and writes the group's rows of `out` itself.
                bf16 = self.bf16_prefill is not None \
                    and q.dtype == k_cache.dtype == torch.bfloat16
                (self.bf16_prefill if bf16 else self.kernels.paged_prefill_)(
                    out, q, k_cache, v_cache, g.block_tables, g.query_starts, g.query_lens,
                    g.context_lens, self.block_size, self.scale, sliding_window or 0)
                continue
            else:
                shape = (self.num_kv_heads, g.num_seqs, g.max_context_len, self.head_dim)
                kg = torch.index_select(k_cache.view(by_block), 1, g.key_blocks).view(shape)
                vg = torch.index_select(v_cache.view(by_block), 1, g.key_blocks).view(shape)
                o = self._prefill(q[g.query_rows], kg.to(q.dtype), vg.to(q.dtype),
                                  g.allowed_in(sliding_window))
            if out is None:
                return o.reshape(meta.num_tokens, self.num_heads, self.head_dim)
            out[g.out_rows] = o[g.valid]
        return out

    def _decode(self, q, k_cache, v_cache, g: _Group, window: int | None):
        """q [B, H, D] → [B, 1, H, D]: the C++ kernel over the pool in place when built,
        else a block gather and two batched matmuls."""
        if (g.shared is not None and window is None
                and q.dtype == k_cache.dtype == torch.bfloat16):
            return self._cascade(q, k_cache, v_cache, g, g.shared)
        if self.kernels is not None and q.dtype in self.KERNEL_DTYPES:
            return self.kernels.paged_decode(
                q, k_cache, v_cache, g.block_tables, g.context_lens, self.block_size,
                self.scale, window or 0).unsqueeze(1)
        shape = (self.num_kv_heads, g.num_seqs, g.max_context_len, self.head_dim)
        by_block = (self.num_kv_heads, -1, self.block_size * self.head_dim)
        k = torch.index_select(k_cache.view(by_block), 1, g.key_blocks).view(shape).to(q.dtype)
        v = torch.index_select(v_cache.view(by_block), 1, g.key_blocks).view(shape).to(q.dtype)
        kvh, b, length, d = k.shape
        group = self.num_heads // kvh
        qg = q.view(b, kvh, group, d).transpose(0, 1).reshape(kvh * b, group, d)
        scores = torch.baddbmm(g.decode_bias(q.dtype, kvh, window), qg,
                               k.view(kvh * b, length, d).transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.bmm(probs, v.view(kvh * b, length, d))  # [KVH*B, G, D]
        return o.view(kvh, b, group, d).transpose(0, 1).reshape(b, 1, self.num_heads, d)

    def _cascade(self, q, k_cache, v_cache, g: _Group, shared: SharedPrefix):
        """q [B, H, D] → [B, 1, H, D]: the rows sharing the prefix in one cascade call, the
        others (if any) with the per-row kernel."""
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernels.cascade_decode_amx_(out, q, k_cache, v_cache, g.block_tables,
                                         g.context_lens, shared.rows, shared.tokens,
                                         self.block_size, self.scale)
        if shared.others is not None:
            out[shared.others] = self.kernels.paged_decode(
                q[shared.others], k_cache, v_cache, shared.other_tables, shared.other_lens,
                self.block_size, self.scale, 0)
        return out.unsqueeze(1)

    def _prefill(self, q, k, v, allowed):
        """q [B, Q, H, D], k/v [KVH, B, L, D] → [B, Q, H, D]."""
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed[:, None],
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)
