"""A suffix tree of token sequences, truncated at a depth, with occurrence counts.

Suffix decoding (Arctic Inference, arXiv 2411.04975) drafts from the strings of
earlier text that continue the tail of a request. For every string s of at most
`max_depth` tokens the tree knows `count(s)`, the number of positions at which s
occurs in its sequences; a node's children are the tokens that followed s, and
`count(s + t) / count(s)` estimates the probability of t after s. `speculate` matches
the context's last m tokens for every m, follows the most frequent child from there
while the product of those ratios stays at or above `min_token_prob`, for at most
`max_spec_factor * m` tokens, and keeps the draft with the highest score (the sum of
its tokens' probabilities): the semantics of Arctic Inference's `SuffixTree`.

The representation keeps memory proportional to the repeated text, not to tokens x
depth. A string that occurs once is not a node: it is a `Tail`, a reference to its one
occurrence (the sequence's token list and an index), which grows for free as its
sequence grows. Only strings seen at least twice become `Node`s, one token at a time,
when a second occurrence walks into a tail (`_extend`). Appending a token touches each
of the sequence's last `max_depth` suffixes once (their deepest node is kept between
calls), so `append` is O(max_depth) and `speculate` O(max_depth^2) dict lookups,
independent of the sequences' lengths. `remove` walks the sequence's suffixes and
takes their counts back; nodes whose count reaches zero are deleted.

Each node keeps its most frequent child (`best`), so the greedy walk never scans
siblings. Ties go to the child that reached the count most recently, and a new child
never displaces an equal one: the order Arctic's sibling lists keep.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

# Probabilities and scores within EPS compare equal: a ratio such as 0.3 x 1/3 must meet
# a threshold of 0.1 whatever the rounding.
EPS = 1e-6


class Tail:
    """The one occurrence of every string below this point: `seq[start:]`, cut at the
    tree's depth (the tokens are those of the sequence as it is now)."""

    __slots__ = ("seq", "start")
    count = 1

    def __init__(self, seq: list[int], start: int):
        self.seq, self.start = seq, start

    @property
    def token(self) -> int:
        return self.seq[self.start]


class Node:
    """A string seen at least twice (or the root): its count and its children by token."""

    __slots__ = ("count", "token", "children", "best")

    def __init__(self, count: int, token: int):
        self.count, self.token = count, token
        self.children: dict[int, Node | Tail] = {}
        self.best: Node | Tail | None = None  # the child with the highest count


class _Suffix:
    """One of a sequence's last `max_depth` suffixes: where its path leaves the nodes."""

    __slots__ = ("start", "node", "depth")

    def __init__(self, start: int, node: Node):
        self.start, self.node, self.depth = start, node, 0


class SuffixTree:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node(0, -1)
        self.seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, deque[_Suffix]] = {}
        self.num_nodes = 1

    def __contains__(self, key: Hashable) -> bool:
        return key in self.seqs

    def num_tokens(self) -> int:
        return sum(map(len, self.seqs.values()))

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `key` (a new one if absent)."""
        if key not in self.seqs:
            self.seqs[key] = []
            self._active[key] = deque()
        seq, active = self.seqs[key], self._active[key]
        for token in tokens:
            self._append(seq, active, token)

    def _append(self, seq: list[int], active: deque[_Suffix], token: int) -> None:
        at = len(seq)
        seq.append(token)  # every tail of this sequence now reaches one token further
        root = self.root
        root.count += 1
        active.append(_Suffix(at, root))
        if len(active) > self.max_depth:
            active.popleft()
        for suffix in active:
            self._extend(suffix, seq, at, token)

    def _extend(self, suffix: _Suffix, seq: list[int], at: int, token: int) -> None:
        """Bring `suffix` (its path ends at `at`, before `token`) one token deeper."""
        node, depth, start = suffix.node, suffix.depth, suffix.start
        end = at - start  # the suffix's depth before the token
        while depth < end:  # nodes made since the last call (another occurrence split
            child = node.children[seq[start + depth]]  # this suffix's tail)
            if child.__class__ is Tail:
                suffix.node, suffix.depth = node, depth
                return  # inside its own tail, which grew with `seq`
            node, depth = child, depth + 1
        child = node.children.get(token)
        if child is None:
            tail = node.children[token] = Tail(seq, at)
            if node.best is None:
                node.best = tail
        elif child.__class__ is Tail:  # a second occurrence: the string becomes a node
            new = node.children[token] = Node(2, token)
            self.num_nodes += 1
            nxt = child.start + 1
            if nxt < len(child.seq) and depth + 2 <= self.max_depth:
                new.best = new.children[child.seq[nxt]] = Tail(child.seq, nxt)
            self._raised(node, new, child)
            node, depth = new, depth + 1
        else:
            child.count += 1
            self._raised(node, child, child)
            node, depth = child, depth + 1
        suffix.node, suffix.depth = node, depth

    @staticmethod
    def _raised(node: Node, child: Node, was: Node | Tail) -> None:
        best = node.best
        if best is None or best is was or child.count >= best.count:
            node.best = child

    def remove(self, key: Hashable) -> None:
        """Forget sequence `key`: every count its suffixes added is taken back."""
        seq = self.seqs.pop(key)
        del self._active[key]
        limit = self.max_depth
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for depth in range(min(limit, len(seq) - start)):
                token = seq[start + depth]
                child = node.children[token]
                if child.__class__ is Tail or child.count == 1:
                    del node.children[token]  # only this suffix was there
                    if child.__class__ is Node:
                        self.num_nodes -= self._size(child)
                    if node.best is child:
                        node.best = max(node.children.values(), key=_count, default=None)
                    break
                child.count -= 1
                best = node.best
                if best is child or best is None:
                    node.best = max(node.children.values(), key=_count)
                node = child

    def _size(self, node: Node) -> int:
        return 1 + sum(self._size(c) for c in node.children.values() if c.__class__ is Node)

    def speculate(self, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float, min_token_prob: float
                  ) -> tuple[list[int], float, int]:
        """The best draft after `context`: (tokens, score, match length)."""
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        n = len(context)
        for m in range(1, n):
            found = self._match(context, n - m)
            if found is None:
                break  # a longer context cannot match where a shorter one did not
            limit = min(max_spec_tokens, int(m * max_spec_factor + 1e-6))
            tokens, score = self._walk(*found, m, limit, min_token_prob)
            if score >= best[1] - EPS:  # a tie goes to the longer match
                best = (tokens, score, m)
        return best

    def _match(self, context: Sequence[int], begin: int) -> tuple[Node, Tail | None, int] | None:
        """Where `context[begin:]` ends: (node, None, 0) at a node, or (its parent, tail,
        index in the tail's sequence of the next token) inside a tail; None: absent."""
        node, tail, at = self.root, None, 0
        for i in range(begin, len(context)):
            token = context[i]
            if tail is None:
                child = node.children.get(token)
                if child is None:
                    return None
                if child.__class__ is Tail:
                    tail, at = child, child.start + 1
                else:
                    node = child
            elif at < len(tail.seq) and tail.seq[at] == token:
                at += 1
            else:
                return None
        return node, tail, at

    def _walk(self, node: Node, tail: Tail | None, at: int, depth: int, limit: int,
              min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation from a match, while its probability holds."""
        tokens: list[int] = []
        prob, score, max_depth = 1.0, 0.0, self.max_depth
        while len(tokens) < limit and depth < max_depth:
            if tail is None:
                child = node.best
                if child is None:
                    break
                prob *= child.count / node.count
                if prob < min_prob - EPS:
                    break
                if child.__class__ is Tail:
                    tail, at = child, child.start
                    continue
                node = child
                tokens.append(child.token)
            elif at < len(tail.seq):
                tokens.append(tail.seq[at])
                at += 1
            else:
                break
            score += prob
            depth += 1
        return tokens, score


def _count(x: Node | Tail) -> int:
    return x.count
