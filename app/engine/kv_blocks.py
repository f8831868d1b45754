"""The KV block manager: a fixed pool of blocks rented out to requests, and a prefix cache.

The pool tensors live on the model thread; this file only does the bookkeeping, in
plain Python, on the event loop. A request's block table lists the pool blocks
holding its tokens in order: the token at position p lives in slot
`table[p // block_size] * block_size + p % block_size`.

Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention by other
means). A *full* block is named by a hash chained over its parent block's hash and
its own token ids (and room for extra keys such as an adapter id), so a name stands
for the whole prefix up to that block. When a block fills, its name goes into the
cache index. A request that arrives with a prompt whose leading blocks are named
there starts with those blocks in its table — shared, reference-counted — and
computes only the rest. A partial (last) block is never shared: it is still being
written. When the last table holding a named block lets go, the block is not wiped:
it stays in the pool as *cached and evictable*, in LRU order, and is reused when a
later prompt matches, or evicted when a fresh block is needed and no free one is left.

Invariant (`check()`, cheap enough to run after every test scenario): every block is
exactly one of free (no content), evictable (named, no table), or referenced (in at
least one table); a block's reference count equals the number of tables holding it;
`free + evictable + referenced == total`; the index names only evictable or
referenced blocks. `counts()` is the O(1) version that /health and /metrics show.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from app.engine.kv_events import KVEventLog


class NoFreeBlocks(RuntimeError):
    pass


def chain_hash(parent: int | None, tokens: Sequence[int], extra: Hashable = None) -> int:
    """The name of a full block: its tokens, everything before it (through `parent`),
    and `extra` (e.g. an adapter id) — two blocks share a name only if all three agree."""
    return hash((parent, tuple(tokens), extra))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._refs = [0] * num_blocks
        self._name: list[int | None] = [None] * num_blocks  # set while in the index
        self._index: dict[int, int] = {}  # name -> block
        self._tables: dict[str, list[int]] = {}
        self._num_referenced = 0
        self.events: KVEventLog | None = None  # set to publish what the cache holds

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: free ones and cached ones that can be evicted."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_referenced

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, 0.0 – 1.0 (vLLM's kv_cache_usage_perc:
        cached blocks nobody holds count as free)."""
        return self._num_referenced / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Whether `num_tokens` fit, after taking the cached blocks `hits` as its prefix."""
        taken = sum(1 for b in hits if self._refs[b] == 0)  # evictable ones stop being free
        need = self.blocks_for(num_tokens) - len(hits) - len(self._tables.get(request_id, ()))
        return max(0, need) <= self.num_free_blocks - taken

    # -- the prefix cache ----------------------------------------------------------------

    def block_names(self, tokens: Callable[[int, int], Sequence[int]], names: list[int],
                    limit: int, extra: Hashable = None) -> list[int]:
        """Extend `names` (a request's chain so far) to cover the full blocks of its first
        `limit` tokens (`tokens(start, end)` slices them); each block is hashed once in a
        request's life."""
        bs = self.block_size
        for i in range(len(names), limit // bs):
            names.append(chain_hash(names[-1] if names else None,
                                    tokens(i * bs, (i + 1) * bs), extra))
        return names

    def match_prefix(self, names: Sequence[int]) -> list[int]:
        """Cached blocks for the longest prefix of `names` the index holds."""
        if not self.enable_caching:
            return []
        hits = []
        for name in names:
            block = self._index.get(name)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, request_id: str, names: Sequence[int], start_block: int,
                 end_block: int, tokens: Callable[[int, int], Sequence[int]] | None = None,
                 lora_id: int = 0) -> None:
        """Name the request's blocks [start_block, end_block), now full: later prompts
        may share them. A name already held by another block keeps that block. With an
        event log, each run of newly named blocks is a `BlockStored` (`tokens(a, b)`
        slices the request's token ids; `lora_id` tags it with the request's adapter)."""
        if not self.enable_caching:
            return
        table = self._tables[request_id]
        run: list[int] = []
        for i in range(start_block, min(end_block, len(table), len(names))):
            block, name = table[i], names[i]
            if self._name[block] is None and name not in self._index:
                self._name[block] = name
                self._index[name] = block
                run.append(i)
            elif run:
                self._stored(names, run, tokens, lora_id)
                run = []
        if run:
            self._stored(names, run, tokens, lora_id)

    def _stored(self, names: Sequence[int], run: list[int], tokens, lora_id: int) -> None:
        if self.events is not None and tokens is not None:
            first, last, bs = run[0], run[-1], self.block_size
            self.events.stored([names[i] for i in run], names[first - 1] if first else None,
                               list(tokens(first * bs, (last + 1) * bs)), lora_id or None)

    def reset_prefix_cache(self) -> int:
        """Forget every name: cached blocks become free; blocks in use are no longer
        shared with later requests. Returns how many cached blocks were dropped."""
        dropped = len(self._evictable)
        if self.events is not None:
            self.events.cleared()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._index.clear()
        self._name = [None] * self.num_blocks
        return dropped

    # -- renting -------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, hits: Sequence[int] = ()) -> None:
        """Grow the request's table to hold `num_tokens` tokens, starting a new table with
        the shared blocks `hits`; all or nothing."""
        if not self.can_allocate(request_id, num_tokens, hits):
            raise NoFreeBlocks(f"no room for {num_tokens} tokens of {request_id}")
        table = self._tables.setdefault(request_id, [])
        if hits:
            assert not table, "prefix hits only start a table"
            for block in hits:
                self._ref(block)
                table.append(block)
        for _ in range(self.num_new_blocks_needed(request_id, num_tokens)):
            block = self._fresh()
            self._ref(block)
            table.append(block)

    def free(self, request_id: str) -> int:
        """Let go of all the request's blocks; freeing twice is a no-op. The tail goes
        first into the LRU order, so a shared prefix outlives the blocks after it."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        for block in reversed(table):
            self._unref(block)
        return len(table)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Let go of the request's blocks past its first `num_tokens` tokens (those that
        held only rejected draft tokens); returns how many. Such tail blocks were never
        full of computed tokens, so never named: they go back to the free list."""
        table = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        dropped = 0
        while table and len(table) > keep:
            self._unref(table.pop())
            dropped += 1
        return dropped

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._num_referenced -= 1
            if self._name[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._num_referenced += 1
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _fresh(self) -> int:
        """A block with no content: a free one, else the least recently used cached one."""
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        del self._index[self._name[block]]
        if self.events is not None:
            self.events.removed([self._name[block]])
        self._name[block] = None
        return block

    # -- reading -------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool slots for positions [start, end) of the request."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def owners(self) -> list[str]:
        return list(self._tables)

    def counts(self) -> dict[str, int]:
        """free / cached / used blocks and how many tables hold them, O(1): a lost block
        shows as a sum that is not the total, a leaked table as one no request owns."""
        return {"free": len(self._free), "cached": len(self._evictable),
                "used": self._num_referenced, "total": self.num_blocks,
                "tables": len(self._tables)}

    def check(self) -> None:
        """Assert the pool invariant (see the module docstring)."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a table holds a block twice"
            for b in table:
                held[b] = held.get(b, 0) + 1
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & evictable and not free & set(held) and not evictable & set(held), \
            "a block is in two states"
        assert len(free) + len(evictable) + len(held) == self.num_blocks, (
            f"free {len(free)} + cached {len(evictable)} + used {len(held)} "
            f"!= total {self.num_blocks}")
        assert all(self._refs[b] == held.get(b, 0) for b in range(self.num_blocks)), \
            "a reference count differs from the tables holding the block"
        assert self._num_referenced == len(held)
        for name, block in self._index.items():
            assert self._name[block] == name and block not in free, "the index names a free block"
        assert all(self._name[b] is not None for b in evictable), "a cached block has no name"
