"""Sampling a batch: grammar masks, logit bias, penalties, bans, temperature, top-k, top-p,
min-p, seeds, logprobs.

Rows are independent: a seeded row's draw comes from (seed, output_index) alone, so
its tokens do not depend on the other rows of the batch, nor on whether the request
was preempted and recomputed in between.

A draw is one uniform number per row, chosen on the host (53 bits: a stream owned by
the sampler, or the row's own seed), and the first token whose cumulative probability
passes it (inverse transform sampling: one cumulative sum, one binary search). The
exponential race it replaced drew a noise value per vocabulary entry, and torch's
generator made that ~28 ns each on CPU: 22 ms of a 16-row step (49k entries a row).

Batched, and without stalling the host: which rows need what is decided from the
rows themselves, on the host, never by reading device values back; every per-row
value the device needs (temperatures, bans, penalty counts to fold) arrives in one
asynchronous copy (`gpu/staging.py`), and all results leave in one wait. A batch of
greedy rows with nothing else asked is one argmax.

The order of a step, each stage over the rows that need it:
1. raw log-probabilities, for rows that asked for logprobs (before anything changes
   the logits);
2. adjustments of the logits, for every row: penalties, bans. Anything else that
   must bind greedy rows too (a logit bias, a structured-output token mask) belongs
   here, before the split;
3. greedy rows: argmax; sampled rows: temperature, top-k and top-p (one `topk` for the
   rows with a top-k, a full sort only for rows with top-p alone), min-p, then the
   draw. On CPU with the C++ kernels built, each of these is one kernel call instead
   (`Sampler.__init__`): this torch path is then their reference;
4. the sampled tokens' logprobs and each row's top ones, and the copy to the host.
"""

from __future__ import annotations

import random
from typing import Any, Generic, NamedTuple, TypeVar, get_type_hints

import torch

from gpu.batch import SamplingRow
from gpu.cpu.capabilities import CpuCapabilities
from gpu.penalties import PenaltyCounts
from gpu.staging import Staging, to_host

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
LONG, FLOAT = torch.long, torch.float32
UNIFORM_BITS = 53  # a double's mantissa: every uniform is exact in float64, and below 1

Logprobs = tuple[float, list[tuple[int, float]]] | None

Ints = TypeVar("Ints")  # list[int] on the host, an int64 tensor on the device
Floats = TypeVar("Floats")  # list[float] on the host, a float32 tensor on the device


class RowValues(NamedTuple, Generic[Ints, Floats]):
    """Every per-row value a step's device work reads, by name: the host lists
    (`HostValues`, built in `Sampler._stage_row_values` alone) and their device twins
    (`StagedValues`: the same fields, arrived by one `Staging.stage` copy). Named fields
    make a misspelt one an AttributeError that a type checker sees; a tuple, so staging
    the values and naming the staged tensors costs one tuple. "(of sampled)": indices
    among the sampled rows, not the batch's."""

    lp: Ints  # rows that asked for logprobs
    pen: Ints  # penalized rows
    slots: Ints  # each penalized row's slot in the counts
    fold_slots: Ints  # (slot, token) pairs to count once more
    fold_tokens: Ints
    mark_slots: Ints  # (slot, token) pairs of new slots' prompts to mark
    mark_tokens: Ints
    ban_rows: Ints  # (row, token) pairs to ban
    ban_tokens: Ints
    sampled: Ints  # rows that draw (the others take the argmax)
    top_k_rows: Ints  # (of sampled) rows with a top-k
    top_k: Ints  # their k
    top_p_rows: Ints  # (of sampled) rows with a top-p and no top-k
    uniform_bits: Ints  # each sampled row's draw
    row_top_k: Ints  # each sampled row's top-k (0: none), for the kernel
    repetition: Floats  # the penalized rows' penalties
    presence: Floats
    frequency: Floats
    temperature: Floats  # each sampled row's
    min_p: Floats
    top_k_p: Floats  # the top-p of the `top_k_rows`
    top_p: Floats  # the top-p of the `top_p_rows`
    row_top_p: Floats  # each sampled row's top-p, for the kernel


HostValues = RowValues[list[int], list[float]]
StagedValues = RowValues[torch.Tensor, torch.Tensor]
# Each field's device dtype, in field order, read from its annotation.
_HINTS = get_type_hints(RowValues)
_DTYPES = tuple(LONG if _HINTS[name] is Ints else FLOAT for name in RowValues._fields)


def row_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 ^ (output_index + 1) * _GOLDEN) & _MASK63


def uniform_bits(rng: random.Random, row: SamplingRow) -> int:
    """The row's draw as an integer below 2**UNIFORM_BITS: from the sampler's stream, or
    for a seeded row from its (seed, output_index) alone."""
    if row.seed is not None:
        rng = random.Random(row_seed(row.seed, row.output_index))
    return rng.getrandbits(UNIFORM_BITS)


def inverse_transform(probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalised) `probs`: the first whose cumulative probability
    exceeds u · total, u = bits / 2**53 in [0, 1). A zero-probability token never adds to
    the sum, so it is never the first to pass; u · total < total in float64, so some
    token always does (the clamp only guards a row of NaNs)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = bits.double().mul_(2.0**-UNIFORM_BITS).mul_(cdf[:, -1])
    drawn = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return drawn.clamp_(max=probs.shape[-1] - 1)


def keep_top(probs: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor,
             k_max: int) -> torch.Tensor:
    """Which tokens survive top-k then top-p (as vLLM: top-p over the renormalised
    top-k): a bool mask like `probs`. Only the `k_max` most likely tokens are ranked."""
    if k_max < probs.shape[-1]:
        ranked, order = probs.topk(k_max, dim=-1)
    else:
        ranked, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if k is not None:
        rank = torch.arange(ranked.shape[-1], device=probs.device)[None, :]
        keep = rank < k[:, None]
        ranked = ranked * keep
    ranked = ranked / ranked.sum(-1, keepdim=True)
    exclusive_cum = ranked.cumsum(-1) - ranked
    keep &= exclusive_cum <= p[:, None]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """xgrammar bitmask rows (int32 words, bit j of word i = token 32·i + j) as bools."""
    return ((words.unsqueeze(-1) >> _BITS) & 1).bool().flatten(-2)[..., :width]


def shape_logits(logits: torch.Tensor, rows: list[tuple[int, SamplingRow]],
                 apply_bitmask=None) -> None:
    """In place: -inf where a row's grammar allows nothing (`row.allowed`), and OpenAI's
    `logit_bias` added. Only rows that ask for either are listed. `apply_bitmask`: the
    CPU kernel that masks straight from the bitmask (this unpacking is its reference)."""
    masked = [(i, r.allowed) for i, r in rows if r.allowed is not None]
    if masked:
        index = torch.tensor([i for i, _ in masked], device=logits.device)
        bitmask = torch.stack([a for _, a in masked])
        if apply_bitmask is not None and logits.dtype == FLOAT and logits.stride(-1) == 1:
            apply_bitmask(logits, index, bitmask)
        else:
            allowed = unpack_bits(bitmask, logits.shape[-1])
            logits[index] = logits[index].masked_fill(~allowed.to(logits.device),
                                                      float("-inf"))
    bias = [(i, t, b) for i, r in rows for t, b in r.logit_bias]
    if bias:
        at = torch.tensor([(i, t) for i, t, _ in bias], device=logits.device).T
        values = torch.tensor([b for _, _, b in bias], dtype=logits.dtype, device=logits.device)
        logits.index_put_((at[0], at[1]), values, accumulate=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0,
                 kernels: CpuCapabilities | Any = None):
        """`kernels`: the runner's `CpuCapabilities` (or the built library's ops, as
        `CpuCapabilities.of` takes them), None off CPU. Where it has them, the C++ ops
        `sample_rows` draws the sampled rows, `argmax_rows` picks the greedy ones,
        `apply_penalties_` penalizes and `apply_token_bitmask_` masks (the torch paths
        are their references)."""
        self.device = device
        capabilities = CpuCapabilities() if kernels is None else CpuCapabilities.of(kernels)
        self.sample_rows = capabilities.op("sample_rows")
        self.apply_bitmask = capabilities.op("apply_token_bitmask_")
        self.argmax_rows = capabilities.op("argmax_rows")
        # Unseeded rows draw from one stream owned by the model thread.
        self.rng = random.Random(seed)
        self.staging = Staging(device)
        self.penalties = PenaltyCounts(device, capabilities)
        self._neg_inf = torch.tensor(float("-inf"), device=device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[Logprobs]]:
        """logits [B, V] → one token id per row (and logprobs where asked). Logits in
        another dtype than float32 (a bf16 model's) are widened, unless every row is
        greedy with nothing else asked: an argmax over the bf16 values is the same."""
        n, vocab = logits.shape
        lp = [i for i, r in enumerate(rows) if r.logprobs is not None]
        pen = [i for i, r in enumerate(rows) if r.penalized]
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        shaped = [i for i, r in enumerate(rows) if r.allowed is not None or r.logit_bias]
        if not (lp or pen or sampled or bans or shaped):  # greedy, nothing else: fast path
            (tokens,) = to_host(self._argmax(logits))
            return tokens.tolist(), [None] * n
        logits = logits.float()  # a no-op for float32

        s_rows = [rows[i] for i in sampled]
        host, dev, progress = self._stage_row_values(rows, lp, pen, bans, sampled, vocab)

        # 1. Raw log-probabilities, before any adjustment.
        raw = None
        if lp:
            raw = torch.log_softmax(logits if len(lp) == n else logits[dev.lp], dim=-1)
        # 2. Adjustments that bind every row: a grammar's mask and logit_bias first.
        if pen or bans or shaped:
            logits = logits.clone()
        if shaped:
            shape_logits(logits, [(i, rows[i]) for i in shaped], self.apply_bitmask)
        if pen:
            self.penalties.fold(dev.fold_slots, dev.fold_tokens, dev.mark_slots,
                                dev.mark_tokens, progress)
            self.penalties.apply_(logits, dev.pen, dev.slots, dev.repetition, dev.presence,
                                  dev.frequency)
        if bans:
            logits.index_put_((dev.ban_rows, dev.ban_tokens), self._neg_inf)
        # 3. Greedy rows take the argmax; sampled rows draw.
        if len(sampled) == n:
            tokens = self._draw(logits, s_rows, host, dev, vocab)
        else:
            tokens = self._argmax(logits)
            if sampled:
                drawn = self._draw(logits[dev.sampled], s_rows, host, dev, vocab)
                tokens.index_copy_(0, dev.sampled, drawn)
        # 4. Logprobs, and the one wait.
        if raw is None:
            (host_tokens,) = to_host(tokens)
            return host_tokens.tolist(), [None] * n
        return self._with_logprobs(raw, tokens, rows, lp, dev)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.argmax_rows is not None and logits.dtype in (FLOAT, torch.bfloat16) \
                and logits.stride(-1) == 1:
            return self.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _stage_row_values(self, rows: list[SamplingRow], lp: list[int], pen: list[int],
                          bans: list[tuple[int, int]], sampled: list[int], vocab: int
                          ) -> tuple[HostValues, StagedValues, list]:
        """Every per-row value the device needs, sent in one copy: (the host values, their
        device twins, the penalty progress to record once folded)."""
        folds = self.penalties.prepare([rows[i] for i in pen], vocab)
        s_rows = [rows[i] for i in sampled]
        top_k_rows = [j for j, r in enumerate(s_rows) if r.top_k > 0]
        top_p_rows = [j for j, r in enumerate(s_rows) if r.top_k <= 0 and r.top_p < 1]
        host: HostValues = RowValues(
            lp=lp, pen=pen, slots=folds.slots, fold_slots=folds.fold_slots,
            fold_tokens=folds.fold_tokens, mark_slots=folds.mark_slots,
            mark_tokens=folds.mark_tokens, ban_rows=[i for i, _ in bans],
            ban_tokens=[t for _, t in bans], sampled=sampled,
            top_k_rows=top_k_rows, top_k=[s_rows[j].top_k for j in top_k_rows],
            top_p_rows=top_p_rows,
            uniform_bits=[uniform_bits(self.rng, r) for r in s_rows],
            row_top_k=[r.top_k for r in s_rows],
            repetition=[rows[i].repetition_penalty for i in pen],
            presence=[rows[i].presence_penalty for i in pen],
            frequency=[rows[i].frequency_penalty for i in pen],
            temperature=[r.temperature for r in s_rows],
            min_p=[r.min_p for r in s_rows],
            top_k_p=[s_rows[j].top_p for j in top_k_rows],
            top_p=[s_rows[j].top_p for j in top_p_rows],
            row_top_p=[r.top_p for r in s_rows],
        )
        staged: StagedValues = RowValues(*self.staging.stage(*zip(host, _DTYPES)))
        return host, staged, folds.progress

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], host: HostValues,
              dev: StagedValues, vocab: int) -> torch.Tensor:
        if self.sample_rows is not None and logits.dtype == FLOAT and logits.stride(-1) == 1:
            return self.sample_rows(logits, dev.temperature, dev.row_top_k, dev.row_top_p,
                                    dev.min_p, dev.uniform_bits)
        probs = torch.softmax(logits / dev.temperature[:, None], dim=-1)
        # (rows, their device indices, k, p, most tokens kept): top-k rows, then top-p alone.
        cuts = ((host.top_k_rows, dev.top_k_rows, dev.top_k, dev.top_k_p,
                 max(host.top_k, default=vocab)),
                (host.top_p_rows, dev.top_p_rows, None, dev.top_p, vocab))
        for chosen, at, k, p, k_max in cuts:
            if not chosen:
                continue
            every = len(chosen) == len(rows)
            sub = probs if every else probs[at]
            sub = sub.masked_fill(~keep_top(sub, k, p, min(k_max, vocab)), 0.0)
            if every:
                probs = sub
            else:
                probs[at] = sub
        if any(r.min_p > 0 for r in rows):  # relative to the most likely token left
            floor = dev.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return inverse_transform(probs, dev.uniform_bits)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                       lp: list[int], dev: StagedValues) -> tuple[list[int], list[Logprobs]]:
        picked = tokens if len(lp) == len(rows) else tokens[dev.lp]
        chosen = raw.gather(1, picked[:, None])[:, 0]
        k_max = max(rows[i].logprobs for i in lp)
        if k_max:
            top = raw.topk(k_max, dim=-1)
            host_tokens, chosen, top_ids, top_lps = to_host(tokens, chosen, top.indices,
                                                            top.values)
            top_ids, top_lps = top_ids.tolist(), top_lps.tolist()
        else:
            host_tokens, chosen = to_host(tokens, chosen)
        out: list[Logprobs] = [None] * len(rows)
        for j, (i, value) in enumerate(zip(lp, chosen.tolist())):
            k = rows[i].logprobs
            out[i] = (value, list(zip(top_ids[j][:k], top_lps[j][:k])) if k else [])
        return host_tokens.tolist(), out
