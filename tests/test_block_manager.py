"""BlockManager: exact block ids, ref counts, prefix-cache reuse and LRU eviction."""
from __future__ import annotations

import random

from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.block_manager import BlockManager
from xserv_aot.engine.sequence import Sequence


def mkseq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), seed=0)


def compute_all(bm, seq):
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def test_allocate_append_free_exact_ids():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = mkseq(range(10), "a"), mkseq(range(100, 105), "b")
    assert bm.can_allocate(a)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5
    for t in (10, 11):                             # tokens 10, 11 still fit in block 2
        a.append_token(t)
        assert bm.can_append(a)
        bm.append(a)
    assert a.block_table == [0, 1, 2]
    a.append_token(12)                             # 13th token: a new block
    bm.append(a)
    assert a.block_table == [0, 1, 2, 5]
    bm.free(b)                                     # tail first: 4 then 3 go to the back of the free queue
    assert b.block_table == [] and bm.ref_counts[3] == bm.ref_counts[4] == 0
    c = mkseq(range(200, 212), "c")
    bm.allocate(c)
    assert c.block_table == [6, 7, 4]
    assert not bm.can_allocate(mkseq(range(8), "d"))   # needs 2, one left
    bm.free(a)
    bm.free(c)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)


def test_prefix_hit_reuses_exact_blocks_and_counts_refs(seed):
    bm = BlockManager(10, 4)
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(12)]
    a = mkseq(prompt, "a")
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 0
    compute_all(bm, a)
    b = mkseq(prompt[:8] + [7, 7, 7], "b")
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (2 + 2, 2)
    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1] and bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(10, 4)
    prompt = list(range(50, 62))
    a = mkseq(prompt, "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = mkseq(prompt, "b")
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]             # block 2 holds the last token: not shared, recomputed
    assert b.num_computed_tokens == 8 < b.num_tokens


def test_only_full_computed_blocks_are_cached():
    bm = BlockManager(10, 4)
    prompt = list(range(30, 41))                   # 11 tokens: blocks of 4, 4, 3
    a = mkseq(prompt, "a")
    bm.allocate(a)
    a.num_computed_tokens = 5                      # first chunk computed only block 0 fully
    bm.cache_blocks(a)
    assert bm.num_cached_blocks == 1
    b = mkseq(prompt + [1, 2, 3], "b")
    bm.allocate(b)
    assert b.block_table[:1] == [0] and b.num_cached_tokens == 4
    compute_all(bm, a)                             # 11 tokens: the partial third block is never cached
    assert bm.num_cached_blocks == 2
    c = mkseq(prompt + [9], "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == [0, 1] and c.block_table[2] != 2


def test_lru_eviction_tail_first_and_oldest_first():
    bm = BlockManager(8, 2)
    a, c = mkseq([1, 2, 3, 4, 5], "a"), mkseq([11, 12, 13], "c")
    bm.allocate(a)
    bm.allocate(c)
    assert a.block_table == [0, 1, 2] and c.block_table == [3, 4]
    compute_all(bm, a)                             # caches blocks 0 and 1
    compute_all(bm, c)                             # caches block 3
    bm.free(a)                                     # evictable: 1, 0 (tail first); block 2 plain free
    bm.free(c)                                     # evictable: 1, 0, 3; block 4 plain free
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    d = mkseq([90] * 11, "d")                      # 6 fresh: plain 5, 6, 7, 2, 4 first, then evict 1
    bm.allocate(d)
    assert d.block_table == [5, 6, 7, 2, 4, 1]
    f = mkseq([77, 77], "f")                       # evicts 0 (a's head) before 3 (c, freed later)
    bm.allocate(f)
    assert f.block_table == [0] and bm.num_cached_blocks == 1
    bm.free(f)
    bm.free(d)
    again_a, again_c = mkseq([1, 2, 3], "a2"), mkseq([11, 12, 13], "c2")
    bm.allocate(again_a)
    bm.allocate(again_c)
    assert again_a.num_cached_tokens == 0
    assert again_c.num_cached_tokens == 2 and again_c.block_table[0] == 3


def test_can_allocate_counts_evictable_hits():
    bm = BlockManager(3, 2)
    a = mkseq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = mkseq([1, 2, 3, 4, 6], "b")                # 2 hits (ref 0) + 1 fresh = the whole pool
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 2] and b.num_cached_tokens == 4
    assert not bm.can_allocate(mkseq([1, 2], "x"))


def test_random_ops_never_share_a_block_being_written():
    rng = random.Random(0)
    bm = BlockManager(16, 4)
    live: list[Sequence] = []
    for step in range(600):
        op = rng.random()
        if op < 0.3:
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            s = mkseq(base + [rng.randrange(5) for _ in range(rng.randrange(1, 10))], f"s{step}")
            if bm.can_allocate(s):
                bm.allocate(s)
                live.append(s)
        elif op < 0.8 and live:
            s = rng.choice(live)
            s.num_computed_tokens = s.num_tokens   # "run" it, then decode one token
            bm.cache_blocks(s)
            s.append_token(rng.randrange(5))
            if bm.can_append(s):
                bm.append(s)
            else:
                bm.free(s)
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        owners: dict[int, list[Sequence]] = {}
        for s in live:
            assert len(s.block_table) == -(-s.num_tokens // 4)
            for i, blk in enumerate(s.block_table):
                owners.setdefault(blk, []).append((s, i))
        for blk, users in owners.items():
            assert bm.ref_counts[blk] == len(users)
            if len(users) > 1:                     # shared: same full, computed prefix in every user
                contents = {tuple(s.token_ids[:(i + 1) * 4]) for s, i in users}
                assert len(contents) == 1
                assert all(s.num_computed_tokens >= (i + 1) * 4 for s, i in users)
        assert bm.num_used_blocks == len(owners)
    for s in live:
        bm.free(s)
    assert bm.num_used_blocks == 0
