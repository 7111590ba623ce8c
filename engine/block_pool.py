"""The pool of physical KV blocks: allocation, reference counts and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks, identified by ``0 .. num_blocks - 1``.

    Structures:
        ref_counts[b]: how many sequences hold block ``b``.
        free queue: the blocks with ref count 0, in eviction order (least recently freed
            first; a sequence's blocks are freed tail first, so shared prefix blocks stay
            cached longest). ``OrderedDict`` gives O(1) pop-front, append and removal.
        cached: prefix hash -> block holding exactly those tokens (full blocks only).
        block_hash[b]: the hash block ``b`` is registered under, if any.

    Invariants:
        - a block is in the free queue iff its ref count is 0; ref counts are never negative;
        - ``cached[h] == b`` iff ``block_hash[b] == h``;
        - a cached block may sit in the free queue (lazy eviction): it keeps its contents and
          hash until it is handed out again, and a prefix hit takes it back out of the queue.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting their hashes."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"out of KV blocks: want {num_blocks}, have {len(self._free)}")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks already holding data (prefix hits, forks)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue's end."""
        for block in blocks:
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than it was allocated")
            self.ref_counts[block] = count
            if count == 0:
                self._free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` a prefix hit would take out of the free queue."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash (first writer wins)."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash

    def forget(self, blocks: Iterable[int]) -> None:
        """Take blocks held by one sequence only out of the prefix cache (their contents are
        not to be trusted); shared blocks were computed by others and stay."""
        for block in blocks:
            if self.ref_counts[block] == 1:
                self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
