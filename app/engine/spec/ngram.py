"""The n-gram (prompt lookup) proposer: what followed the last time the tail appeared.

For n from `max_n` down to `min_n`, the sequence's last n tokens are looked for earlier
in the sequence (prompt and output); at the most recent earlier occurrence, the tokens
that followed it are the drafts. The longest n that matches wins: a longer context
predicts better. Where the copy runs into the tail itself (a loop shorter than the
drafts), it continues over the drafts already made, as an LZ77 copy does, so a
repeating pattern yields a full set of drafts.

The search is one `bytes.rfind` per n over the tokens packed as 32-bit words: C speed,
O(length) per step for a request, with no index kept between steps.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from app.engine.request import Request

WORD = 4  # bytes per packed token


def find_drafts(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts for the sequence `tokens` (see the module docstring)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    packed = array("I", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = packed[(length - n) * WORD:]
        end = (length - 1) * WORD  # a match must end before the last token: one follows
        while True:
            at = packed.rfind(tail, 0, end)
            if at < 0 or at % WORD == 0:
                break
            end = at + len(tail) - 1  # a match across word boundaries: look further back
        if at < 0:
            continue
        start = at // WORD + n  # the first token that followed the match
        drafts: list[int] = []
        for i in range(k):
            j = start + i
            drafts.append(tokens[j] if j < length else drafts[j - length])
        return drafts
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[list[int]]:
        return [find_drafts(r.prompt_token_ids + r.output_token_ids, self.min_n, self.max_n, k)
                for r, k in zip(requests, num_tokens)]

    def finish(self, request: Request) -> None:
        pass  # nothing is kept between steps
