"""Per-sequence block tables, prefix caching and copy-on-write on top of the block pool."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

from engine.block_pool import BlockPool
from engine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: Seq[int], extra: bytes = b"") -> bytes:
    """Chain hash of a full block: parent block's hash + this block's token ids + extra keys.

    SHA-256 rather than Python's ``hash`` so that a crafted prompt cannot collide with another
    tenant's prefix and read its KV.
    """
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def _root(seq: Sequence) -> bytes | None:
    # A LoRA adapter's blocks chain from their own root: its KV is never the base model's
    # (or another adapter's) for the same tokens.
    return None if seq.lora is None else hashlib.sha256(b"lora\0" + seq.lora.encode()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each sequence's logical blocks to physical blocks of a :class:`BlockPool`.

    Invariants:
        - block ``i`` of ``seq.block_table`` holds the KV of tokens ``[i*B, (i+1)*B)``;
        - after ``allocate_slots(seq, n)`` the table covers ``seq.num_computed_tokens + n``
          tokens, and the block receiving the first new token has ref count 1 (copy-on-write
          if it was shared; the copy is queued in ``pending_copies`` for the runner);
        - ``seq.block_hashes[i]`` is the chain hash of tokens ``[0, (i+1)*B)`` (and the
          sequence's cache salt and LoRA adapter); the first ``seq.num_cached_blocks``
          blocks are registered;
        - only full blocks are registered, and a registered block is never written again.

    Swap preemption uses a second pool of ``num_host_blocks`` blocks in host memory
    (``host_pool``, ``None`` without one): a swapped-out sequence's KV is in the blocks of
    ``seq.host_block_table`` and its ``block_table`` is empty. Moving blocks between the pools
    returns the copies for the runner to make before the step's forward.

    Methods come in check/act pairs: ``can_allocate_slots`` / ``allocate_slots``,
    ``can_swap_out`` / ``swap_out``, ``can_swap_in`` / ``swap_in``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
        num_host_blocks: int = 0,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []

    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else _root(seq)
            extra = seq.cache_salt.encode() if (i == 0 and seq.cache_salt) else b""
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence with no KV yet.

        At least the last token is left to compute, since its logits are needed.
        """
        return self._cached_blocks(seq, (seq.num_tokens - 1) // self.block_size)

    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = ()
    ) -> int:
        """Free blocks ``allocate_slots`` would consume (new, copy-on-write, revived hits)."""
        table_len = len(seq.block_table) + len(cached)
        start = seq.num_computed_tokens + len(cached) * self.block_size
        new = max(0, cdiv(start + num_new_tokens, self.block_size) - table_len)
        return new + int(self._needs_copy(seq, start)) + self.pool.num_evictable(cached)

    def can_allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = ()
    ) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(seq, num_new_tokens, cached))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = ()) -> None:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens, after taking prefix hits.

        The caller advances ``seq.num_computed_tokens`` by ``len(cached) * block_size``.
        """
        bs = self.block_size
        if cached:
            self.pool.touch(cached)
            seq.block_table.extend(cached)
            seq.num_cached_blocks = len(cached)
        start = seq.num_computed_tokens + len(cached) * bs
        if self._needs_copy(seq, start):
            i = start // bs
            src = seq.block_table[i]
            (dst,) = self.pool.allocate(1)
            self.pending_copies.append((src, dst))
            self.pool.free([src])
            seq.block_table[i] = dst
        missing = cdiv(start + num_new_tokens, bs) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self.pool.allocate(missing))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start + num_new_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (copy-on-write on the next write)."""
        child.block_table = list(parent.block_table)
        self.pool.touch(child.block_table)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (device blocks tail first, so shared prefixes are
        evicted last; host blocks of a swapped-out sequence too)."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        if seq.host_block_table:
            assert self.host_pool is not None
            self.host_pool.free(seq.host_block_table)
            seq.host_block_table = []

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_pool is not None and self.host_pool.can_allocate(len(seq.block_table))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give ``seq``'s KV host blocks and free its device blocks (registered ones stay in the
        prefix cache); return the (device block, host block) copies to make."""
        assert self.host_pool is not None
        host = self.host_pool.allocate(len(seq.block_table))
        copies = list(zip(seq.block_table, host, strict=True))
        self.free(seq)
        seq.host_block_table = host
        return copies

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq`` can come back with slots for ``num_new_tokens`` more tokens."""
        hits = self._swap_in_hits(seq)
        table_len = max(len(seq.host_block_table),
                        cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        need = table_len - len(hits) + self.pool.num_evictable(hits)
        return self.pool.can_allocate(need)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give a swapped-out ``seq`` device blocks again; return the (host block, device block)
        copies to make. Leading blocks still in the prefix cache are taken from it instead."""
        assert self.host_pool is not None
        hits = self._swap_in_hits(seq)
        self.pool.touch(hits)
        fresh = self.pool.allocate(len(seq.host_block_table) - len(hits))
        copies = list(zip(seq.host_block_table[len(hits) :], fresh, strict=True))
        self.host_pool.free(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = hits + fresh
        seq.num_cached_blocks = len(hits)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, seq.num_computed_tokens)
        return copies

    def _swap_in_hits(self, seq: Sequence) -> list[int]:
        return self._cached_blocks(seq, seq.num_computed_tokens // self.block_size)

    def _cached_blocks(self, seq: Sequence, max_blocks: int) -> list[int]:
        # The blocks of the longest cached prefix of seq's first max_blocks blocks.
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def forget(self, seq: Sequence) -> None:
        """Drop the prefix-cache entries of the blocks only ``seq`` holds (before freeing it
        after a failed step)."""
        self.pool.forget(seq.block_table)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _needs_copy(self, seq: Sequence, start: int) -> bool:
        i = start // self.block_size
        return i < len(seq.block_table) and self.pool.ref_counts[seq.block_table[i]] > 1

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # Blocks are registered when scheduled: the forward that fills them runs before any
        # later step reads them, and within a step every layer writes its K/V before reading.
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self.update_hashes(seq)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_cached_blocks = num_full
