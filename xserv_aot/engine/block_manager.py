"""Paged KV cache bookkeeping: a fixed pool of block ids, per-sequence block tables, ref counts, prefix caching.

Prefix caching: a full block whose KV has been computed is registered under a hash chained on the previous
block's hash (blake2b of prev hash + the block's token ids), so equal prefixes map to equal hashes. `allocate`
reuses registered blocks for the leading full blocks of a sequence. A freed block with a hash stays cached
(ref count 0, "evictable") until a fresh block is needed; plain free blocks are handed out first, then evictable
ones in least-recently-freed order. The last partial block is never registered, and a block whose KV is still
being computed is never registered, so a cache hit always reads finished KV and no step writes into a shared
block. Fresh blocks come out of the free queue in FIFO order (initially 0, 1, 2, ...).

Fork (parallel samples of one prompt): the child shares the parent's computed full blocks of that prompt (ref
count + 1 each; their KV is final, nobody writes them again) and gets private fresh blocks for the rest; the last
partial block is never shared: each child recomputes its few tokens into its own block (copy-on-write by recompute:
no device copy), which also gives each child the last prompt token's logits for its own first sample.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from xserv_aot.engine.sequence import Sequence


def block_hash(prev: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"\0" * 16)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.reset()

    def reset(self) -> None:
        """Forget every allocation and cached block (after an engine failure)."""
        self.ref_counts = [0] * self.num_blocks
        self._hash_of: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}                        # hash -> block id
        self._free: deque[int] = deque(range(self.num_blocks))     # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()   # ref 0, hashed; oldest first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """Leading cached blocks of seq, as (block id, hash). The block holding the last token is never matched,
        so at least one token is recomputed and the step has logits for it."""
        if not self.enable_prefix_caching:
            return []
        hits, prev = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = block_hash(prev, seq.block_tokens(i, self.block_size))
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append((bid, h))
            prev = h
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._lookup(seq)
        in_use = sum(1 for bid, _ in hits if self.ref_counts[bid] > 0)
        return self.blocks_needed(seq.num_tokens) - in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached leading blocks; sets num_computed/cached_tokens."""
        assert not seq.block_table, f"{seq.request_id}: allocate with a non-empty block table"
        hits = self._lookup(seq)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += (seq.num_tokens - 1) // self.block_size
            self.prefix_cache_hits += len(hits)
        for bid, _ in hits:
            if self.ref_counts[bid] == 0:
                del self._evictable[bid]
            self.ref_counts[bid] += 1
        seq.block_table = [bid for bid, _ in hits]
        seq.block_hashes = [h for _, h in hits]
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_fresh())
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def num_forkable(self, parent: Sequence, child: Sequence) -> int:
        """Leading blocks child can share with parent: full, computed, and inside child's prompt but its last token."""
        n = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        return n if parent.token_ids[:n * self.block_size] == child.token_ids[:n * self.block_size] else 0

    def can_fork(self, parent: Sequence, child: Sequence) -> bool:
        return self.blocks_needed(child.num_tokens) - self.num_forkable(parent, child) <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Allocate child (empty block table) sharing parent's leading blocks; sets num_computed/cached_tokens."""
        assert not child.block_table, f"{child.request_id}: fork with a non-empty block table"
        n = self.num_forkable(parent, child)
        shared = parent.block_table[:n]
        for bid in shared:
            self.ref_counts[bid] += 1
        child.block_table = list(shared)
        child.block_hashes = parent.block_hashes[:n] if len(parent.block_hashes) >= n else []
        for _ in range(self.blocks_needed(child.num_tokens) - n):
            child.block_table.append(self._take_fresh())
        child.num_cached_tokens = child.num_computed_tokens = n * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of every token of seq (a decode needs a new block when its last one is full)."""
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_fresh())

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of seq whose KV is now computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(prev, seq.block_tokens(i, self.block_size))
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if h not in self._cached and self._hash_of[bid] is None:
                self._cached[h] = bid
                self._hash_of[bid] = h

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, so a prefix's head blocks are evicted last."""
        for bid in reversed(seq.block_table):
            assert self.ref_counts[bid] > 0, f"block {bid} freed twice"
            self.ref_counts[bid] -= 1
            if self.ref_counts[bid] == 0:
                if self._hash_of[bid] is not None:
                    self._evictable[bid] = None
                else:
                    self._free.append(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _take_fresh(self) -> int:
        if self._free:
            bid = self._free.popleft()
        elif self._evictable:
            bid, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of[bid]]
            self._hash_of[bid] = None
        else:
            raise RuntimeError("KV block pool exhausted (scheduler must check can_allocate/can_append)")
        assert self.ref_counts[bid] == 0
        self.ref_counts[bid] = 1
        return bid
