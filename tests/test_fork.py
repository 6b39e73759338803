"""Parallel samples of one prompt share its KV: BlockManager.fork with exact block ids, the scheduler holding a
child until its parent's prompt blocks are computed, and engine outputs equal to the unpaged reference (FakeRunner
reads every context back through the block tables, so a wrong shared block changes the tokens)."""
from __future__ import annotations

import random

import pytest

from tests.fake_runner import FakeRunner, reference_generate
from tests.test_engine import VOCAB, mkbuild, mkengine
from tests.test_scheduler import Sched, step
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.block_manager import BlockManager
from xserv_aot.engine.sequence import Sequence


def seq(rid, prompt):
    return Sequence(rid, prompt, SamplingParams(), seed=0)


def test_fork_shares_full_computed_blocks_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10, 20))                         # 10 tokens: blocks 0, 1 full, block 2 partial
    parent = seq("p", prompt)
    bm.allocate(parent)
    parent.num_computed_tokens = 10
    bm.cache_blocks(parent)
    assert parent.block_table == [0, 1, 2]
    a, b = seq("a", prompt), seq("b", prompt)
    assert bm.num_forkable(parent, a) == 2 and bm.can_fork(parent, a)
    bm.fork(parent, a)
    bm.fork(parent, b)
    assert a.block_table == [0, 1, 3] and b.block_table == [0, 1, 4]
    assert (a.num_computed_tokens, a.num_cached_tokens) == (8, 8)
    assert bm.ref_counts[:5] == [3, 3, 1, 1, 1] and bm.num_free_blocks == 3
    assert a.block_hashes == parent.block_hashes[:2]
    bm.free(parent)
    assert bm.ref_counts[:5] == [2, 2, 0, 1, 1]
    for s in (a, b):
        bm.free(s)
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8


def test_fork_of_a_partly_computed_parent_and_of_a_different_prompt():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = seq("p", list(range(12)))
    bm.allocate(parent)
    parent.num_computed_tokens = 5                       # one full block computed so far
    child = seq("c", list(range(12)))
    assert bm.num_forkable(parent, child) == 1
    other = seq("o", [99] + list(range(1, 12)))
    assert bm.num_forkable(parent, other) == 0
    exact = seq("e", list(range(8)))                     # 8 tokens: the last token's block is never shared
    parent.num_computed_tokens = 12
    assert bm.num_forkable(parent, exact) == 1


def test_scheduler_holds_children_until_the_parent_prompt_is_computed():
    s = Sched(mkbuild(prefill_buckets=[8], num_blocks=16))
    prompt = [random.Random(5).randrange(1000) for _ in range(10)]
    p, a, b = seq("p", prompt), seq("a", prompt), seq("b", prompt)
    for x in (p, a, b):
        s.add(x)
    assert a.fork_parent is p and b.fork_parent is p and p.fork_parent is None
    o = step(s)                                          # the parent's first chunk (8 tokens); children wait
    assert [x.request_id for x in o.seqs] == ["p"] and o.batch.block_tables == [[0, 1, 2]]
    o = step(s)                                          # parent: last 2 prompt tokens; its KV for 0..7 is final
    assert [x.request_id for x in o.seqs] == ["p", "a", "b"]
    assert o.batch.block_tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert o.num_new_tokens == [2, 2, 2] and o.batch.positions == [8, 9] * 3
    assert o.batch.slot_mapping == [8, 9, 12, 13, 16, 17]
    assert o.samples == [True, True, True]
    assert [(r.row, r.num_computed_tokens, r.block_ids) for r in o.update.new_rows] == [(1, 8, [0, 1, 3]),
                                                                                        (2, 8, [0, 1, 4])]
    for x in (p, a, b):
        s.finish(x, "stop")
    assert s.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("overlap", [False, True])
def test_forked_samples_equal_the_unpaged_reference(overlap):
    eng = mkengine(mkbuild(num_blocks=64), overlap=overlap)
    rng = random.Random(17)
    prompt = [rng.randrange(VOCAB) for _ in range(23)]
    params = [SamplingParams(temperature=1.0, seed=100 + j, max_tokens=12, ignore_eos=True) for j in range(4)]
    outs = eng.generate([prompt] * 4, params)
    for p, o in zip(params, outs):
        assert o.new_token_ids == reference_generate(prompt, p, p.seed, VOCAB)
    assert len({tuple(o.new_token_ids) for o in outs}) == 4
    assert [o.num_cached_tokens for o in outs] == [0, 20, 20, 20]
    assert eng.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_fork_survives_preemption_in_a_small_pool(overlap):
    """10 blocks of 4 for 3 samples of a 13-token prompt growing to 25 tokens: preemption, yet exact outputs."""
    eng = mkengine(runner=FakeRunner(mkbuild(num_blocks=10), VOCAB), overlap=overlap)
    prompt = list(range(13))
    params = [SamplingParams(temperature=0.8, seed=j, max_tokens=12, ignore_eos=True) for j in range(3)]
    outs = eng.generate([prompt] * 3, params)
    for p, o in zip(params, outs):
        assert o.new_token_ids == reference_generate(prompt, p, p.seed, VOCAB)
    assert eng.scheduler.num_preemptions > 0
    assert eng.scheduler.block_manager.num_used_blocks == 0
