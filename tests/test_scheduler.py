"""Scheduler: decode-first batches, chunked prefill with exact slots/positions, budgets, preemption order."""
from __future__ import annotations

import random

from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.scheduler import Scheduler
from xserv_aot.engine.sequence import Sequence, SequenceStatus


def mkbuild(**kw) -> BuildConfig:
    d = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[8], max_seq_len=64, block_size=4,
             num_blocks=16, target="cpu")
    d.update(kw)
    return BuildConfig(**d).validate()


def mkseq(n, rid, params=None, seed=0):
    return Sequence(rid, [random.randrange(1000) for _ in range(n)], params or SamplingParams(), seed=seed)


def step(sched, token=7):
    """What the engine does around the runner: schedule, commit, append a token for every sampling row."""
    out = sched.schedule()
    sched.commit(out)
    for seq, samples in zip(out.seqs, out.samples):
        if samples:
            seq.append_token(token)
    return out


def test_chunked_prefill_exact_batches():
    s = Scheduler(mkbuild())
    a = mkseq(10, "a")
    s.add(a)
    o = step(s, token=42)
    b = o.batch
    assert b.input_ids == a.prompt_ids[:8] and b.positions == list(range(8)) and b.slot_mapping == list(range(8))
    assert b.query_start_loc == [0, 8] and b.seq_lens == [8] and b.block_tables == [[0, 1, 2]]
    assert o.samples == [False] and a.num_computed_tokens == 8
    o = step(s, token=43)
    b = o.batch
    assert b.input_ids == a.prompt_ids[8:] and b.positions == [8, 9] and b.slot_mapping == [8, 9]
    assert b.query_start_loc == [0, 2] and b.seq_lens == [10] and o.samples == [True]
    assert b.sample_offsets == [0]
    o = step(s)
    b = o.batch
    assert b.input_ids == [43] and b.positions == [10] and b.slot_mapping == [10] and b.seq_lens == [11]
    assert b.sample_offsets == [1] and o.samples == [True]


def test_decodes_first_then_prefill_chunks_under_budget():
    s = Scheduler(mkbuild())
    a, b, c = mkseq(6, "a"), mkseq(6, "b"), mkseq(3, "c")
    for q in (a, b, c):
        s.add(q)
    o = step(s)
    assert o.seqs == [a, b] and o.num_new_tokens == [6, 2] and o.samples == [True, False]
    assert o.batch.query_start_loc == [0, 6, 8] and o.batch.block_tables == [[0, 1], [2, 3]]
    assert o.batch.slot_mapping == [0, 1, 2, 3, 4, 5, 8, 9]
    o = step(s)
    assert o.seqs == [a, b, c] and o.num_new_tokens == [1, 4, 3]
    assert o.batch.query_start_loc == [0, 1, 5, 8]
    assert o.batch.positions == [6, 2, 3, 4, 5, 0, 1, 2]
    assert o.batch.slot_mapping == [6, 10, 11, 12, 13, 16, 17, 18]
    assert o.batch.seq_lens == [7, 6, 3] and o.samples == [True, True, True]
    o = step(s)
    assert o.seqs == [a, b, c] and o.num_new_tokens == [1, 1, 1]
    assert o.batch.positions == [7, 6, 3] and o.batch.slot_mapping == [7, 14, 19]


def test_max_num_seqs_and_budget_limits():
    s = Scheduler(mkbuild())
    seqs = [mkseq(3, f"r{i}") for i in range(6)]
    for q in seqs:
        s.add(q)
    o = step(s)
    assert o.seqs == seqs[:2] + seqs[2:3] and o.num_new_tokens == [3, 3, 2]   # budget 8
    o = step(s)
    assert o.seqs == seqs[:4] and o.num_new_tokens == [1, 1, 1, 3]          # 4 running: no more admitted
    s.finish(seqs[1], "stop")
    o = step(s)
    assert o.seqs == [seqs[0], seqs[2], seqs[3], seqs[4]] and o.num_new_tokens == [1, 1, 1, 3]


def test_preempts_newest_first_and_requeues_in_order():
    s = Scheduler(mkbuild(num_blocks=4, prefill_buckets=[16]))
    a, b, c, d = (mkseq(4, r) for r in "abcd")
    for q in (a, b, c, d):
        s.add(q)
    o = step(s)
    assert [q.block_table for q in (a, b, c, d)] == [[0], [1], [2], [3]] and all(o.samples)
    o = step(s)                                    # every decode needs a 5th-token block; none free
    assert o.preempted == [d, c] and o.seqs == [a, b]
    assert a.block_table == [0, 3] and b.block_table == [1, 2]
    assert o.batch.slot_mapping == [12, 8] and o.batch.positions == [4, 4]
    assert list(s.waiting) == [c, d] and s.num_preemptions == 2
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    o = step(s)                                    # a, b fit in their blocks; c, d cannot be admitted yet
    assert o.seqs == [a, b] and not o.preempted
    s.finish(a, "stop")
    s.finish(b, "stop")
    o = step(s)                                    # c recomputes its 5 tokens (block 2 was evicted for b)
    assert o.seqs == [c, d] and o.num_new_tokens == [5, 5] and o.samples == [True, True]
    assert o.batch.input_ids[:5] == c.token_ids[:5] and o.batch.sample_offsets == [1, 1]


def test_preemption_of_itself_when_newest():
    s = Scheduler(mkbuild(num_blocks=3, prefill_buckets=[16]))
    a, b = mkseq(4, "a"), mkseq(8, "b")
    s.add(a)
    s.add(b)
    step(s)                                        # a: [0], b: [1, 2]
    o = step(s)                                    # a needs a block: preempts b (newest)
    assert o.preempted == [b] and o.seqs == [a] and a.block_table == [0, 2]


def test_lone_sequence_that_cannot_grow_fails_instead_of_deadlocking():
    s = Scheduler(mkbuild(num_blocks=2, prefill_buckets=[16]))
    a = mkseq(8, "a")
    s.add(a)
    o = step(s)
    assert o.samples == [True] and a.num_tokens == 9
    o = step(s)
    assert o.is_empty and o.failed == [a]
    assert a.finish_reason == "error" and "KV cache too small" in a.error
    assert s.block_manager.num_used_blocks == 0 and not s.has_unfinished()


def test_waiting_sequence_larger_than_the_pool_fails():
    s = Scheduler(mkbuild(num_blocks=2))
    big, small = mkseq(12, "big"), mkseq(3, "small")
    s.add(big)
    s.add(small)
    o = step(s)
    assert o.failed == [big] and o.seqs == [small] and big.is_finished


def test_need_logits_only_for_sampling_host_rows():
    s = Scheduler(mkbuild())
    host = SamplingParams(logprobs=2, temperature=0.5, top_k=3, top_p=0.9, seed=5)
    a = Sequence("a", list(range(12)), host, seed=5)
    s.add(a)
    o = step(s)
    assert o.samples == [False] and not o.batch.need_logits
    o = step(s)
    assert o.samples == [True] and o.batch.need_logits
    assert (o.batch.temperature, o.batch.top_k, o.batch.top_p, o.batch.seeds) == ([0.5], [3], [0.9], [5])


def test_random_load_respects_limits_and_frees_everything():
    rng = random.Random(1)
    build = mkbuild(num_blocks=10, prefill_buckets=[8, 16])
    s = Scheduler(build)
    pending = [Sequence(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 20))], SamplingParams(),
                        seed=i) for i in range(30)]
    targets = {q.request_id: rng.randrange(1, 12) for q in pending}
    done = 0
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            s.add(pending.pop())
        if not s.has_unfinished():
            if not pending:
                break
            continue
        decoding = {id(q) for q in s.running if q.num_uncomputed_tokens == 1}
        o = step(s)
        b = o.batch
        assert b.num_tokens <= build.prefill_chunk and b.num_seqs <= build.max_num_seqs
        kinds = [id(q) in decoding for q in o.seqs]
        assert kinds == sorted(kinds, reverse=True), "decodes must come before prefill chunks"
        assert len({id(q) for q in o.seqs}) == len(o.seqs)
        for q in o.failed:
            raise AssertionError(f"{q.request_id} failed: {q.error}")
        for q, smp in zip(o.seqs, o.samples):
            if smp and q.num_output_tokens >= targets[q.request_id]:
                s.finish(q, "length")
                done += 1
    assert done == 30 and s.block_manager.num_used_blocks == 0


def test_mixed_step_caps_prompt_tokens_while_decodes_run():
    """With decodes running, a long prompt gets at most mixed_prefill_tokens a step (exact rows and blocks);
    alone, it takes the whole prefill chunk."""
    random.seed(11)
    s = Scheduler(mkbuild(prefill_buckets=[4, 8], mixed_prefill_tokens=3, num_blocks=32))
    a = mkseq(2, "a")
    s.add(a)
    o = step(s)
    assert o.seqs == [a] and o.num_new_tokens == [2] and o.batch.block_tables == [[0]]
    long = mkseq(12, "long")
    s.add(long)
    o = step(s)                                   # a decodes, long takes 3 prompt tokens (not 7)
    assert o.seqs == [a, long] and o.num_new_tokens == [1, 3] and o.samples == [True, False]
    assert o.batch.query_start_loc == [0, 1, 4] and o.batch.positions == [2, 0, 1, 2]
    assert o.batch.block_tables == [[0], [1, 2, 3]] and o.batch.slot_mapping == [2, 4, 5, 6]
    o = step(s)
    assert o.num_new_tokens == [1, 3] and o.batch.positions == [3, 3, 4, 5] and o.batch.slot_mapping == [3, 7, 8, 9]
    s.finish(a, "stop")
    o = step(s)                                   # no decodes left: the chunk budget is the largest bucket
    assert o.seqs == [long] and o.num_new_tokens == [6] and o.batch.positions == list(range(6, 12))


def test_mixed_prefill_tokens_bounds():
    import pytest
    from xserv_aot.config import ConfigError
    with pytest.raises(ConfigError, match="mixed_prefill_tokens"):
        mkbuild(mixed_prefill_tokens=9)
    assert mkbuild().mixed_prefill_budget == 8 and mkbuild(mixed_prefill_tokens=5).mixed_prefill_budget == 5
