"""Per-row sampling: logit bias, penalties, bans, temperature, top-k, top-p, min-p, seeds.

Rows are independent: a seeded row draws from a generator seeded by
(seed, output_index), so its tokens do not depend on the other rows of the
batch, nor on whether the request was preempted and recomputed in between.
"""

from __future__ import annotations

import torch

from gpu.batch import SamplingRow

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def row_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 ^ (output_index + 1) * _GOLDEN) & _MASK63


def _token_counts(row: SamplingRow, logits: torch.Tensor) -> torch.Tensor | None:
    """How often each token occurs in the row's output so far, or None before any.

    Kept on the row between steps and brought up to date with only the tokens
    appended since the last call (usually one), so the cost per token does not
    grow with the output's length.
    """
    state = row.penalty_state
    if state is None:
        if not row.output_token_ids:
            return None
        state = row.penalty_state = [torch.zeros(logits.shape[-1], device=logits.device), 0]
    counts, counted = state
    new = row.output_token_ids[counted:]
    if new:
        ones = torch.ones(len(new), device=counts.device)
        counts.index_add_(0, torch.tensor(new, device=counts.device), ones)
        state[1] = counted + len(new)
    return counts


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """An xgrammar bitmask row (int32 words, bit j of word i = token 32·i + j) as bools."""
    return ((words.unsqueeze(-1) >> _BITS) & 1).bool().reshape(-1)[:width]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        # Unseeded rows share one generator owned by the model thread.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
        """logits [B, V] float32 → one token id per row (and logprobs where asked)."""
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.logprobs is not None for r in rows) else None
        )
        logits = self._apply_penalties_and_bans(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            gi = torch.tensor(greedy, device=logits.device)
            tokens[gi] = logits[gi].argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        if sampled:
            si = torch.tensor(sampled, device=logits.device)
            tokens[si] = self._sample(logits[si], [rows[i] for i in sampled])
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, rows, token_list)

    @staticmethod
    def _apply_penalties_and_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        touched = False
        for i, r in enumerate(rows):
            counts = _token_counts(r, logits) if r.penalized else None
            if not (r.banned_token_ids or counts is not None or r.logit_bias
                    or r.allowed is not None):
                continue
            if not touched:
                logits, touched = logits.clone(), True
            row = logits[i]
            if r.allowed is not None:  # a grammar: only the tokens it allows next
                row.masked_fill_(~_unpack_bits(r.allowed, row.shape[-1]).to(row.device),
                                 float("-inf"))
            if r.logit_bias:  # OpenAI's logit_bias: added before penalties and sampling
                ids, bias = zip(*r.logit_bias)
                row[list(ids)] += torch.tensor(bias, dtype=row.dtype, device=row.device)
            if counts is not None:
                seen = counts > 0
                if r.repetition_penalty != 1.0:  # CTRL-style, as in HF / vLLM
                    penalized = torch.where(row > 0, row / r.repetition_penalty,
                                            row * r.repetition_penalty)
                    row.copy_(torch.where(seen, penalized, row))
                row -= r.presence_penalty * seen + r.frequency_penalty * counts
            if r.banned_token_ids:
                row[list(r.banned_token_ids)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([r.temperature for r in rows], device=dev, dtype=logits.dtype)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        top_k = torch.tensor([r.top_k if r.top_k > 0 else 0 for r in rows], device=dev)
        top_p = torch.tensor([r.top_p for r in rows], device=dev, dtype=probs.dtype)
        min_p = torch.tensor([r.min_p for r in rows], device=dev, dtype=probs.dtype)
        if (top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[-1], device=dev)[None, :]
            sorted_p = sorted_p.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), 0.0)
            sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)  # top-p after top-k, as vLLM
            exclusive_cum = sorted_p.cumsum(-1) - sorted_p
            sorted_p = sorted_p.masked_fill(exclusive_cum > top_p[:, None], 0.0)
            sorted_p = sorted_p.masked_fill(sorted_p < min_p[:, None] * sorted_p[:, :1], 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine).
        # Unseeded rows share one draw (one kernel); each seeded row draws on its own.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(row_seed(r.seed, r.output_index))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, rows: list[SamplingRow], tokens: list[int]):
        if raw is None:
            return [None] * len(rows)
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, r in enumerate(rows):
            if r.logprobs is None:
                out.append(None)
                continue
            top = raw[i].topk(r.logprobs) if r.logprobs else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append((raw[i, tokens[i]].item(), pairs))
        return out
