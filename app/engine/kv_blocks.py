"""The KV block manager: a fixed pool of blocks rented out to requests.

The pool tensors themselves live on the model thread; this file only does the
bookkeeping, in plain Python, on the event loop. A request's block table lists
the pool blocks holding its tokens in order: token at position p lives in slot
`table[p // block_size] * block_size + p % block_size`.

Invariant (checked by `check()`): every block is either free or in exactly one
request's table, so `num_free + num_used == num_blocks`.
"""

from __future__ import annotations


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 – 1.0 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's table to hold `num_tokens` tokens; all or nothing."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(f"need {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._free.pop())

    def free(self, request_id: str) -> int:
        """Return all the request's blocks to the pool; freeing twice is a no-op."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool slots for positions [start, end) of the request."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def owners(self) -> list[str]:
        return list(self._tables)

    def check(self) -> None:
        """Assert the pool invariant; cheap enough to run after every test scenario."""
        used = [b for t in self._tables.values() for b in t]
        assert len(set(used)) == len(used), "a block is owned twice"
        assert len(set(self._free)) == len(self._free), "a block is free twice"
        assert not set(used) & set(self._free), "a block is both free and used"
        assert len(used) + len(self._free) == self.num_blocks, (
            f"free {len(self._free)} + used {len(used)} != total {self.num_blocks}"
        )
        assert all(0 <= b < self.num_blocks for b in used + self._free), "block id out of range"
