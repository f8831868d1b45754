"""CPU speed-up: pre-pack linear weights into oneDNN's blocked layout once.

Unpacked, the matmul library re-blocks the weight on every call; packed at load time
it does not. Measured per layer shape (SmolLM2, docs/benchmarks.md):

- bf16, on a CPU with AVX-512-BF16: up to ~2x faster at one row, ~10% at 64 rows.
- fp32: 1.1-1.8x faster from 4 rows up (decode batches, prefill), but 1.2-1.4x
  *slower* at one row, where the plain weight streams straight from memory. So fp32
  layers keep their plain weight too and use it below `PACKED_MIN_ROWS` rows: the
  weights take twice the memory on CPU (logged at load; the memory plan counts the
  checkpoint's weights, and on CPU the KV pool has its own fixed size).

Results match `F.linear` to rounding. Falls back silently where the op is missing, so
correctness never depends on it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("ridgeline.cpu_linear")

PACKED_MIN_ROWS = 4  # fp32: fewer rows than this run faster on the plain weight


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight is held in oneDNN's packed layout (and, in
    fp32, also as it is, for calls with few rows)."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 64):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.plain = weight if weight.dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.numel() < PACKED_MIN_ROWS * x.shape[-1]:
            return F.linear(x, self.plain)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every bias-free bf16 or fp32 nn.Linear on CPU with a PackedLinear, and give
    a tied LM head (no `lm_head` module) a packed copy of the embedding.

    Returns the bytes the packed copies add to the weights."""
    if not _packing_available():
        return 0
    count, extra = 0, 0

    def packable(w: torch.Tensor) -> bool:
        return w.dtype in (torch.bfloat16, torch.float32) and w.device.type == "cpu"

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None and packable(child.weight):
                setattr(parent, name, PackedLinear(child.weight))
                count += 1
                if child.weight.dtype == torch.float32:  # kept beside its packed copy
                    extra += child.weight.numel() * 4
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None \
            and packable(embed.weight):
        model.lm_head = PackedLinear(embed.weight)
        count += 1
        extra += embed.weight.numel() * embed.weight.element_size()
    if count:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        log.info("packed %d %s linear weights for oneDNN (+%.2f GiB)", count, dtype,
                 extra / 2**30)
    return extra
