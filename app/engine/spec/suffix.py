"""The suffix decoding proposer (vLLM's `suffix`): drafts from the request's own text
and from what earlier requests answered.

Two kinds of suffix tree (`suffix_tree.py`):
- a tree per running request, over its prompt and output: what the answer copies
  from the prompt or repeats of itself;
- one global tree over the outputs of the last `max_cached_requests` requests
  (running ones included, their outputs added as they grow; the oldest evicted first,
  FIFO): what an agent loop or a repeated edit answered before.
Each step a request's context (its last `max_tree_depth` tokens) is matched in both
and the draft with the higher score wins (its own tree on a tie). The draft is as
long as the match allows (`max_spec_factor` x the match length, at most the room the
speculator gives) and stops where the estimated probability of the continuation
falls below `min_token_prob`.

The trees follow the requests incrementally: `propose` appends only the tokens a
request gained since its last step, so a step costs O(depth) per new token and
O(depth^2) per match, whatever the history's length. A request's tree is dropped when
it finishes or is aborted (`finish`); a request that never drafted (a paused
one) still leaves its output in the global tree then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.request import Request
from app.engine.spec.suffix_tree import EPS, SuffixTree


@dataclass
class _Tracked:
    tree: SuffixTree  # the request's prompt and output
    num_outputs: int  # output tokens already in the trees


class SuffixProposer:
    def __init__(self, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float):
        self.depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._order: deque[str] = deque()  # the global tree's requests, oldest first
        self.requests: dict[str, _Tracked] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_tokens):
            local = self._sync(req).tree
            tokens = req.prompt_token_ids + req.output_token_ids \
                if req.num_tokens <= self.depth else self._context(req)
            mine = local.speculate(tokens, k, self.factor, self.min_prob)
            if self.max_cached:
                theirs = self.global_tree.speculate(tokens, k, self.factor, self.min_prob)
                if theirs[1] > mine[1] + EPS:
                    mine = theirs
            out.append(mine[0])
        return out

    def _context(self, req: Request) -> list[int]:
        out, depth = req.output_token_ids, self.depth
        if len(out) >= depth:
            return out[-depth:]
        return req.prompt_token_ids[len(out) - depth:] + out

    def _sync(self, req: Request) -> _Tracked:
        """The request's tree, with every token it has (started on first sight)."""
        rid = req.request_id
        tracked = self.requests.get(rid)
        if tracked is None:
            tree = SuffixTree(self.depth)
            tree.extend(rid, req.prompt_token_ids)
            tracked = self.requests[rid] = _Tracked(tree, 0)
            self._cache(rid)
        new = req.output_token_ids[tracked.num_outputs:]
        if new:
            tracked.tree.extend(rid, new)
            if rid in self.global_tree:  # it may have been evicted while running
                self.global_tree.extend(rid, new)
            tracked.num_outputs += len(new)
        return tracked

    def _cache(self, rid: str) -> None:
        """Start `rid`'s output in the global tree, evicting the oldest past the cap."""
        if not self.max_cached:
            return
        if rid in self.global_tree:  # a request id reused: the newer answer replaces it
            self.global_tree.remove(rid)
            self._order.remove(rid)
        self.global_tree.extend(rid, ())
        self._order.append(rid)
        while len(self._order) > self.max_cached:
            self.global_tree.remove(self._order.popleft())

    def finish(self, req: Request) -> None:
        """The request ended (finished, aborted, failed): its output stays in the global
        tree, its own tree goes."""
        rid = req.request_id
        if rid not in self.requests:
            if not self.max_cached or not req.output_token_ids or rid in self.global_tree:
                return
            self._cache(rid)
            self.global_tree.extend(rid, req.output_token_ids)
            return
        tracked = self.requests.pop(rid)
        new = req.output_token_ids[tracked.num_outputs:]
        if new and rid in self.global_tree:
            self.global_tree.extend(rid, new)
