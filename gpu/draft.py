"""The draft model of speculative decoding (`draft_model`), on the model thread.

A second decoder (any model we load that shares the target's vocabulary) guesses the
next k tokens of a request greedily. This first form keeps no KV cache of its own:
for each request it reads the last `window` tokens of the sequence (at their true
positions) in one forward, then feeds back each guessed token, k forwards in all, with
the keys and values of that one call held in dense tensors (`WindowAttention`) and
dropped after it. Its memory is therefore bounded by one window per call, and it never
touches the target's paged pool; the price is recomputing the window every step, which
a paged draft cache would save. On CUDA that one window's forward is part of the
memory profile (`gpu/profiling.py`), and the weights are counted in the KV pool's plan
(`gpu/memory.py`); it runs eagerly, through torch's attention, outside the CUDA graphs.

What the draft proposes never changes the output: the target verifies every draft
(`app/engine/spec/speculator.py`). A window shorter than the context only makes the
guesses worse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.decoder import DecoderForCausalLM
from models.weights import iter_safetensors

log = logging.getLogger("ridgeline.draft")


@dataclass(frozen=True)
class DraftJob:
    """Per request: its recent tokens, the position of the first, and drafts wanted."""

    windows: list[list[int]]
    starts: list[int]
    num_tokens: list[int]


class WindowAttention:
    """Dense causal attention over one sequence's window, grown token by token within
    one draft call (the `models/attention.py` protocol)."""

    rotates = False

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer_idx, q, k, v, sliding_window=None, rotary=None):
        past = self.keys[layer_idx]
        if past is not None:
            k = torch.cat([past, k])
            v = torch.cat([self.values[layer_idx], v])
        self.keys[layer_idx], self.values[layer_idx] = k, v
        t, n = q.shape[0], k.shape[0]
        # Query i sits at key index n - t + i: it sees keys up to there (and, with a
        # window W, none older than W - 1 before it).
        key_idx = torch.arange(n, device=q.device)
        query_idx = torch.arange(n - t, n, device=q.device)[:, None]
        allowed = key_idx <= query_idx
        if sliding_window is not None:
            allowed &= key_idx > query_idx - sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
            enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)


class DraftModel:
    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device,
                 max_positions: int):
        t0 = time.perf_counter()
        self.config = ModelConfig.from_dir(model_dir)
        self.device = device
        with torch.device("meta"):
            model = DecoderForCausalLM(self.config, max_positions=max_positions)
        model._apply(lambda t: torch.empty(
            t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype))
        model.rotary = model.make_rotary(max_positions).to(device)
        model.load_weights(iter_safetensors(model_dir))
        self.model = model.eval()
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("Draft model %s (%s, %.1f MiB) loaded in %.2f s", model_dir, dtype,
                 self.nbytes / 2**20, time.perf_counter() - t0)

    def largest_call(self, window: int, num_tokens: int) -> Callable[[], object]:
        """The call that peaks highest, for the memory profile: one request's full
        window, then `num_tokens` guesses (requests draft one after another)."""
        return lambda: self.propose(DraftJob([[0] * window], [0], [num_tokens]))

    @torch.inference_mode()
    def propose(self, job: DraftJob) -> list[list[int]]:
        return [self._one(w, s, k) for w, s, k in zip(job.windows, job.starts, job.num_tokens)]

    def _one(self, window: list[int], start: int, k: int) -> list[int]:
        ctx = WindowAttention(len(self.model.layers))
        ids = torch.tensor(window, device=self.device)
        positions = torch.arange(start, start + len(window), device=self.device)
        out: list[int] = []
        for _ in range(k):
            hidden = self.model(ids, positions, ctx)
            token = int(self.model.compute_logits(hidden[-1:], widen=False).argmax(-1))
            out.append(token)
            ids = torch.tensor([token], device=self.device)
            positions = positions[-1:] + 1
        return out
