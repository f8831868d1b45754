"""The suffix decoding proposer (vLLM's `suffix`): drafts from the request's own text
and from what earlier requests answered.

Two kinds of suffix tree (`suffix_tree.py`):
- a tree per running request, over its prompt and output: what the answer copies
  from the prompt or repeats of itself;
- a shared tree per tenant over the outputs of the last `max_cached_requests` requests
  of all tenants (running ones included, their outputs added as they grow; the oldest
  evicted first, FIFO): what an agent loop or a repeated edit answered before. A tenant
  is what scopes the prefix cache (`Request.cache_key`: the `cache_salt`, which the
  server prefixes with the API key's digest, and the LoRA adapter): one tenant's drafts,
  and so its acceptance figures and its latency, never come from another's answers.
Each step a request's context (its last `max_tree_depth` tokens) is matched in its own
tree and its tenant's, and the draft with the higher score wins (its own on a tie). The
draft is as long as the match allows (`max_spec_factor` x the match length, at most the
room the speculator gives) and stops where the estimated probability of the
continuation falls below `min_token_prob`.

The trees follow the requests incrementally: `propose` appends only the tokens a
request gained since its last step, so a step costs O(depth) per new token and
O(depth^2) per match, whatever the history's length. A request's tree is dropped when
it finishes or is aborted (`finish`); a request that never drafted (a paused
one) still leaves its output in its tenant's tree then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
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
        self.global_trees: dict[Hashable, SuffixTree] = {}  # by tenant (`cache_key`)
        self._order: deque[tuple[Hashable, str]] = deque()  # their requests, oldest first
        self.requests: dict[str, _Tracked] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_tokens):
            local = self._sync(req).tree
            tokens = req.prompt_token_ids + req.output_token_ids \
                if req.num_tokens <= self.depth else self._context(req)
            mine = local.speculate(tokens, k, self.factor, self.min_prob)
            shared = self.global_trees.get(req.cache_key)
            if shared is not None:
                theirs = shared.speculate(tokens, k, self.factor, self.min_prob)
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
            self._cache(rid, req.cache_key)
        new = req.output_token_ids[tracked.num_outputs:]
        if new:
            tracked.tree.extend(rid, new)
            shared = self.global_trees.get(req.cache_key)
            if shared is not None and rid in shared:  # it may have been evicted meanwhile
                shared.extend(rid, new)
            tracked.num_outputs += len(new)
        return tracked

    def _cache(self, rid: str, tenant: Hashable) -> None:
        """Start `rid`'s output in its tenant's tree, evicting the oldest of every
        tenant's past the cap."""
        if not self.max_cached:
            return
        tree = self.global_trees.setdefault(tenant, SuffixTree(self.depth))
        if rid in tree:  # a request id reused: the newer answer replaces it
            tree.remove(rid)
            self._order.remove((tenant, rid))
        tree.extend(rid, ())
        self._order.append((tenant, rid))
        while len(self._order) > self.max_cached:
            old_tenant, old = self._order.popleft()
            self.global_trees[old_tenant].remove(old)
            if not self.global_trees[old_tenant].seqs:
                del self.global_trees[old_tenant]

    def finish(self, req: Request) -> None:
        """The request ended (finished, aborted, failed): its output stays in its tenant's
        tree, its own tree goes."""
        rid, tenant = req.request_id, req.cache_key
        shared = self.global_trees.get(tenant)
        if rid not in self.requests:
            if not self.max_cached or not req.output_token_ids or (shared and rid in shared):
                return
            self._cache(rid, tenant)
            self.global_trees[tenant].extend(rid, req.output_token_ids)
            return
        tracked = self.requests.pop(rid)
        new = req.output_token_ids[tracked.num_outputs:]
        if new and shared is not None and rid in shared:
            shared.extend(rid, new)
