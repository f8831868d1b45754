"""Logprobs in the shapes OpenAI's and vLLM's clients parse.

An *entry* is `(token id, logprob or None, [(id, logprob), ...] or None)`: one per
scored token, for the generated tokens (the engine's `logprobs`) and, with `echo`
or `prompt_logprobs`, for the prompt (the first prompt token has no logprob: nothing
comes before it). lm-evaluation-harness scores multiple-choice answers from the
`token_logprobs` of an echoed prompt.
"""

from __future__ import annotations

from app.engine.outputs import RequestOutput

Entry = tuple[int, float | None, list[tuple[int, float]] | None]
FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def decode_each(tok, ids: list[int]) -> list[str]:
    """Each token's own text, in one tokenizer call (not one per token)."""
    rust = getattr(tok, "backend_tokenizer", None)
    if rust is not None:
        return rust.decode_batch([[t] for t in ids], skip_special_tokens=False)
    return [tok.decode([t]) for t in ids]


def _finite(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR


def output_entries(out: RequestOutput, delta_only: bool = False) -> list[Entry]:
    """The generated tokens' entries: the whole output, or this event's delta only."""
    if delta_only:  # a snapshot: the live lists may already be ahead of this event
        pairs = zip(out.delta_token_ids, out.delta_logprobs or [])
    else:
        pairs = zip(out.token_ids, out.logprobs or [])
    return [(t, e[0], e[1]) if e else (t, None, None) for t, e in pairs]


def prompt_entries(prompt: list[int], scores: list | None) -> list[Entry]:
    """The prompt's entries from the engine's prompt logprobs (first None)."""
    scores = scores or [None] * len(prompt)
    return [(t, s[0], s[2]) if s else (t, None, None) for t, s in zip(prompt, scores)]


def completion_logprobs(tok, entries: list[Entry], offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs,
    text_offset (characters from the start of the returned text)."""
    texts = decode_each(tok, [t for t, _, _ in entries])
    top_ids = sorted({i for _, _, top in entries for i, _ in top or ()})
    top_text = dict(zip(top_ids, decode_each(tok, top_ids)))
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in entries],
        "top_logprobs": [None if top is None else {top_text[i]: _finite(v) for i, v in top}
                         for _, _, top in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tok, entries: list[Entry]) -> dict:
    texts = decode_each(tok, [t for t, _, _ in entries])
    top_ids = sorted({i for _, _, top in entries for i, _ in top or ()})
    top_text = dict(zip(top_ids, decode_each(tok, top_ids)))
    return {"content": [
        {"token": text, "logprob": None if lp is None else _finite(lp),
         "top_logprobs": [{"token": top_text[i], "logprob": _finite(v)} for i, v in top or ()]}
        for text, (_, lp, top) in zip(texts, entries)]}


def vllm_prompt_logprobs(tok, prompt: list[int], scores: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: per position {token id: {logprob, rank, decoded_token}},
    the prompt's own token first, then the top k; the first position is null."""
    if scores is None:
        return None
    ids = sorted(set(prompt) | {i for s in scores if s for i, _ in s[2]})
    text = dict(zip(ids, decode_each(tok, ids)))
    out: list = [None]
    for token, score in zip(prompt[1:], scores[1:]):
        lp, rank, top = score
        entry = {str(token): {"logprob": _finite(lp), "rank": rank,
                              "decoded_token": text[token]}}
        for r, (i, v) in enumerate(top, start=1):
            entry.setdefault(str(i), {"logprob": _finite(v), "rank": r,
                                      "decoded_token": text[i]})
        out.append(entry)
    return out
