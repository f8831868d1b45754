"""Speculative decoding: several tokens per step for one sequence, the same text.

A proposer guesses the next few tokens of a decoding request from what the engine
already has (`proposer.py`; the n-gram / prompt-lookup one in `ngram.py`). The
scheduler gives the request `1 + k` positions in the step instead of one: its last
token and the k drafts, written to KV slots like a small prefill chunk. The model
thread scores every one of those positions with the request's own sampling row, as if
the drafts before it were already output (`speculator.py` builds those rows), and
returns the token the target picks at each. The event loop keeps the longest prefix of
drafts the target agreed with, plus the target's own token after it; the KV of the
rejected positions is simply not counted (and their blocks are freed).

Exact by construction: each emitted token is the one plain decoding would have
sampled at that position from the same logits and the same random draw, so greedy
output is token for token that of plain decoding, and sampled output keeps the
target's distribution (docs/speculative.md).
"""
