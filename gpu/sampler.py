"""Sampling a batch: grammar masks, logit bias, penalties, bans, temperature, top-k, top-p,
min-p, seeds, logprobs.

Rows are independent: a seeded row draws from a generator seeded by
(seed, output_index), so its tokens do not depend on the other rows of the
batch, nor on whether the request was preempted and recomputed in between.

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
   exponential race;
4. the sampled tokens' logprobs and each row's top ones, and the copy to the host.
"""

from __future__ import annotations

import torch

from gpu.batch import SamplingRow
from gpu.penalties import PenaltyCounts
from gpu.staging import Staging, to_host

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
LONG, FLOAT = torch.long, torch.float32

Logprobs = tuple[float, list[tuple[int, float]]] | None


def row_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 ^ (output_index + 1) * _GOLDEN) & _MASK63


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


def shape_logits(logits: torch.Tensor, rows: list[tuple[int, SamplingRow]]) -> None:
    """In place: -inf where a row's grammar allows nothing (`row.allowed`), and OpenAI's
    `logit_bias` added. Only rows that ask for either are listed."""
    masked = [(i, r.allowed) for i, r in rows if r.allowed is not None]
    if masked:
        index = torch.tensor([i for i, _ in masked], device=logits.device)
        allowed = unpack_bits(torch.stack([a for _, a in masked]), logits.shape[-1])
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    bias = [(i, t, b) for i, r in rows for t, b in r.logit_bias]
    if bias:
        at = torch.tensor([(i, t) for i, t, _ in bias], device=logits.device).T
        values = torch.tensor([b for _, _, b in bias], dtype=logits.dtype, device=logits.device)
        logits.index_put_((at[0], at[1]), values, accumulate=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        # Unseeded rows share one generator owned by the model thread.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.staging = Staging(device)
        self.penalties = PenaltyCounts(device)
        self._neg_inf = torch.tensor(float("-inf"), device=device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[Logprobs]]:
        """logits [B, V] float32 → one token id per row (and logprobs where asked)."""
        n, vocab = logits.shape
        lp = [i for i, r in enumerate(rows) if r.logprobs is not None]
        pen = [i for i, r in enumerate(rows) if r.penalized and r.output_token_ids]
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        shaped = [i for i, r in enumerate(rows) if r.allowed is not None or r.logit_bias]
        if not (lp or pen or sampled or bans or shaped):  # greedy, nothing else: fast path
            (tokens,) = to_host(logits.argmax(dim=-1))
            return tokens.tolist(), [None] * n

        s_rows = [rows[i] for i in sampled]
        dev, fields, progress = self._stage_row_values(rows, lp, pen, bans, sampled, vocab)

        # 1. Raw log-probabilities, before any adjustment.
        raw = None
        if lp:
            raw = torch.log_softmax(logits if len(lp) == n else logits[dev["lp"]], dim=-1)
        # 2. Adjustments that bind every row: a grammar's mask and logit_bias first.
        if pen or bans or shaped:
            logits = logits.clone()
        if shaped:
            shape_logits(logits, [(i, rows[i]) for i in shaped])
        if pen:
            self.penalties.fold(dev["fold_slots"], dev["fold_tokens"], progress)
            logits[dev["pen"]] = self.penalties.penalize(
                logits[dev["pen"]], dev["slots"], dev["repetition"], dev["presence"],
                dev["frequency"])
        if bans:
            logits.index_put_((dev["ban_rows"], dev["ban_tokens"]), self._neg_inf)
        # 3. Greedy rows take the argmax; sampled rows draw.
        tokens = logits.argmax(dim=-1)
        if sampled:
            picked = logits if len(sampled) == n else logits[dev["sampled"]]
            drawn = self._draw(picked, s_rows, dev, fields, vocab)
            if len(sampled) == n:
                tokens = drawn
            else:
                tokens.index_copy_(0, dev["sampled"], drawn)
        # 4. Logprobs, and the one wait.
        if raw is None:
            (host_tokens,) = to_host(tokens)
            return host_tokens.tolist(), [None] * n
        return self._with_logprobs(raw, tokens, rows, lp, dev)

    def _stage_row_values(self, rows: list[SamplingRow], lp: list[int], pen: list[int],
                          bans: list[tuple[int, int]], sampled: list[int], vocab: int):
        """Every per-row value the device needs, sent in one copy: (device tensors by name,
        the host lists by name, the penalty progress to record once folded)."""
        slots, fold_slots, fold_tokens, progress = self.penalties.prepare(
            [rows[i] for i in pen], vocab)
        s_rows = [rows[i] for i in sampled]
        top_k_rows = [j for j, r in enumerate(s_rows) if r.top_k > 0]
        top_p_rows = [j for j, r in enumerate(s_rows) if r.top_k <= 0 and r.top_p < 1]
        fields = {
            "lp": lp, "pen": pen, "slots": slots, "fold_slots": fold_slots,
            "fold_tokens": fold_tokens, "ban_rows": [i for i, _ in bans],
            "ban_tokens": [t for _, t in bans], "sampled": sampled,
            "top_k_rows": top_k_rows, "top_k": [s_rows[j].top_k for j in top_k_rows],
            "top_p_rows": top_p_rows,
        }
        floats = {
            "repetition": [rows[i].repetition_penalty for i in pen],
            "presence": [rows[i].presence_penalty for i in pen],
            "frequency": [rows[i].frequency_penalty for i in pen],
            "temperature": [r.temperature for r in s_rows],
            "min_p": [r.min_p for r in s_rows],
            "top_k_p": [s_rows[j].top_p for j in top_k_rows],
            "top_p": [s_rows[j].top_p for j in top_p_rows],
        }
        staged = self.staging.stage(*[(v, LONG) for v in fields.values()],
                                    *[(v, FLOAT) for v in floats.values()])
        return dict(zip([*fields, *floats], staged)), fields, progress

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], dev: dict,
              fields: dict, vocab: int) -> torch.Tensor:
        probs = torch.softmax(logits / dev["temperature"][:, None], dim=-1)
        for name, k in (("top_k_rows", dev["top_k"]), ("top_p_rows", None)):
            chosen = fields[name]
            if not chosen:
                continue
            p = dev["top_k_p" if k is not None else "top_p"]
            k_max = max(fields["top_k"]) if k is not None else vocab
            every = len(chosen) == len(rows)
            sub = probs if every else probs[dev[name]]
            sub = sub.masked_fill(~keep_top(sub, k, p, min(k_max, vocab)), 0.0)
            if every:
                probs = sub
            else:
                probs[dev[name]] = sub
        if any(r.min_p > 0 for r in rows):  # relative to the most likely token left
            floor = dev["min_p"][:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine).
        # Unseeded rows share one draw (one kernel); each seeded row draws on its own.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(row_seed(r.seed, r.output_index))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                       lp: list[int], dev: dict) -> tuple[list[int], list[Logprobs]]:
        picked = tokens if len(lp) == len(rows) else tokens[dev["lp"]]
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
