"""Scheduler: decode-first batches, chunked prefill with exact slots/positions, budgets, preemption order."""
from __future__ import annotations

import random

from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.scheduler import Scheduler
from xserv_aot.engine.sequence import Sequence, SequenceStatus
from xserv_aot.runtime.batch import BatchDescription, NewRow
from xserv_aot.runtime.input_batch import InputBatch


def mkbuild(**kw) -> BuildConfig:
    d = dict(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[8], max_seq_len=64, block_size=4,
             num_blocks=16, target="cpu")
    d.update(kw)
    return BuildConfig(**d).validate()


def mkseq(n, rid, params=None, seed=0):
    return Sequence(rid, [random.randrange(1000) for _ in range(n)], params or SamplingParams(), seed=seed)


class Sched(Scheduler):
    """A scheduler with the runner side's persistent batch next to it, as in the engine."""

    def __init__(self, build, **kw):
        super().__init__(build, **kw)
        self.ib = InputBatch(build)


def as_lists(b: BatchDescription) -> BatchDescription:
    fields = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
              "temperature", "top_k", "top_p", "seeds", "sample_offsets")
    return BatchDescription(**{f: [list(map(int, r)) for r in getattr(b, f)] if f == "block_tables"
                               else [x.item() for x in getattr(b, f)] for f in fields}, need_logits=b.need_logits)


def step(sched, token=7):
    """What the engine does around the runner: schedule, prepare the batch, commit, append a token for every
    sampling row (on both sides: the runner side records it as its device sample)."""
    out = sched.schedule()
    if out.is_empty:
        sched.ib.apply(out.update)
    else:
        out.batch = as_lists(sched.ib.prepare(out.update))
        sched.ib.record([token] * len(out.seqs))
    sched.commit(out)
    for seq, samples in zip(out.seqs, out.samples):
        if samples:
            seq.append_token(token)
    return out


def test_chunked_prefill_exact_batches():
    s = Sched(mkbuild())
    a = mkseq(10, "a")
    s.add(a)
    o = step(s, token=42)
    b = o.batch
    assert b.input_ids == a.prompt_ids[:8] and b.positions == list(range(8)) and b.slot_mapping == list(range(8))
    assert b.query_start_loc == [0, 8] and b.seq_lens == [8] and b.block_tables == [[0, 1, 2]]
    assert o.update.new_rows == [NewRow(0, a.prompt_ids, 10, 0, [0, 1, 2], 1.0, 0, 1.0, 0)]
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
    s = Sched(mkbuild())
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
    s = Sched(mkbuild())
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
    s = Sched(mkbuild(num_blocks=4, prefill_buckets=[16]))
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
    s = Sched(mkbuild(num_blocks=3, prefill_buckets=[16]))
    a, b = mkseq(4, "a"), mkseq(8, "b")
    s.add(a)
    s.add(b)
    step(s)                                        # a: [0], b: [1, 2]
    o = step(s)                                    # a needs a block: preempts b (newest)
    assert o.preempted == [b] and o.seqs == [a] and a.block_table == [0, 2]


def test_lone_sequence_that_cannot_grow_fails_instead_of_deadlocking():
    s = Sched(mkbuild(num_blocks=2, prefill_buckets=[16]))
    a = mkseq(8, "a")
    s.add(a)
    o = step(s)
    assert o.samples == [True] and a.num_tokens == 9
    o = step(s)
    assert o.is_empty and o.failed == [a]
    assert a.finish_reason == "error" and "KV cache too small" in a.error
    assert s.block_manager.num_used_blocks == 0 and not s.has_unfinished()


def test_waiting_sequence_larger_than_the_pool_fails():
    s = Sched(mkbuild(num_blocks=2))
    big, small = mkseq(12, "big"), mkseq(3, "small")
    s.add(big)
    s.add(small)
    o = step(s)
    assert o.failed == [big] and o.seqs == [small] and big.is_finished


def test_need_logits_only_for_sampling_host_rows():
    s = Sched(mkbuild())
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
    s = Sched(build)
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
    s = Sched(mkbuild(prefill_buckets=[4, 8], mixed_prefill_tokens=3, num_blocks=32))
    a = mkseq(2, "a")
    s.add(a)
    o = step(s)
    assert o.seqs == [a] and o.num_new_tokens == [2] and o.batch.block_tables == [[0]]
    long = mkseq(12, "long")
    s.add(long)
    o = step(s)                                   # a decodes, long takes 3 prompt tokens (not 7)
    assert o.seqs == [a, long] and o.num_new_tokens == [1, 3] and o.samples == [True, False]
    assert o.batch.query_start_loc == [0, 1, 4] and o.batch.positions == [2, 0, 1, 2]
    assert [row[:n] for row, n in zip(o.batch.block_tables, (1, 3))] == [[0], [1, 2, 3]]
    assert o.batch.slot_mapping == [2, 4, 5, 6]
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
def test_updates_carry_only_what_changed():
    s = Sched(mkbuild(max_num_seqs=2, decode_buckets=[1, 2]))
    a, b = mkseq(7, "a"), mkseq(3, "b")
    s.add(a)
    u = step(s).update                             # a: 7 prompt tokens in blocks 0, 1
    assert [r.row for r in u.new_rows] == [0] and u.new_rows[0].block_ids == [0, 1] and u.rows == [0]
    assert (u.removed, u.new_blocks, u.new_tokens, u.num_scheduled) == ([], [], [], [7])
    u = step(s).update                             # a decodes its 9th token: block 2 is new
    assert (u.new_rows, u.new_blocks, u.rows, u.num_scheduled) == ([], [], [0], [1])
    s.add(b)
    u = step(s).update
    assert u.new_blocks == [(0, [2])] and [r.row for r in u.new_rows] == [1] and u.new_rows[0].block_ids == [3]
    assert u.rows == [0, 1] and u.num_scheduled == [1, 3]
    s.host_token(a, 99)                            # the engine sampled a's last token on the host
    s.finish(b, "stop")
    c = mkseq(2, "c")
    s.add(c)
    o = step(s)
    u = o.update                                   # b's row 1 is freed and given to c in the same update
    assert u.new_tokens == [(0, 99)] and u.removed == [1] and [r.row for r in u.new_rows] == [1]
    assert o.batch.input_ids == [99] + c.prompt_ids
    s.host_token(c, 5)
    s.finish(c, "stop")                            # a host token of a row that left is dropped
    assert step(s).update.new_tokens == []


def test_preempted_row_comes_back_with_all_its_tokens_and_recover_resets():
    s = Sched(mkbuild(num_blocks=3, prefill_buckets=[16]))
    a, b = mkseq(4, "a"), mkseq(8, "b")
    s.add(a)
    s.add(b)
    step(s, token=11)
    o = step(s)                                    # a needs a block: b (row 1) is preempted
    assert o.preempted == [b] and o.update.removed == [1] and o.update.new_blocks == [(0, [2])]
    s.finish(a, "stop")
    o = step(s)
    assert o.update.removed == [0] and o.update.new_rows[0].token_ids == b.prompt_ids + [11]
    r = o.update.new_rows[0]                      # the next free row; its first block is a prefix cache hit
    assert (r.row, r.num_computed_tokens, r.block_ids) == (2, 4, [1, 2, 0]) and o.batch.sample_offsets == [1]
    s.recover([])
    u = step(s).update
    assert u.reset and [r.row for r in u.new_rows] == [0]


def reference_batch(out) -> BatchDescription:
    """The batch built from scratch out of the sequences' own state (what the persistent batch must equal)."""
    b = BatchDescription([], [], [], [0], [], [])
    bs = 4
    for seq, n, sampled in zip(out.seqs, out.num_new_tokens, out.samples):
        start = seq.num_computed_tokens - n        # commit already advanced it, and a sampled token was appended
        b.input_ids += seq.token_ids[start:start + n]
        b.positions += range(start, start + n)
        b.slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        b.query_start_loc.append(b.query_start_loc[-1] + n)
        b.seq_lens.append(start + n)
        b.block_tables.append(list(seq.block_table))
        b.sample_offsets.append(seq.num_output_tokens - sampled)
        b.seeds.append(seq.seed)
    return b


def test_persistent_batch_equals_the_from_scratch_batch_under_random_load():
    seed = 5
    rng = random.Random(seed)
    build = mkbuild(num_blocks=12, prefill_buckets=[8, 16])
    s = Sched(build)
    pending = [Sequence(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 20))], SamplingParams(),
                        seed=i) for i in range(40)]
    steps = 0
    while (pending or s.has_unfinished()) and steps < 3000:
        steps += 1
        if pending and rng.random() < 0.3:
            s.add(pending.pop())
        running = [q for q in s.running if q.num_output_tokens]
        if running and rng.random() < 0.1:
            s.finish(rng.choice(running), "abort")
        if not s.has_unfinished():
            continue
        o = step(s, token=rng.randrange(50))
        if o.is_empty:
            continue
        want = reference_batch(o)
        got = o.batch
        assert (got.input_ids, got.positions, got.slot_mapping, got.query_start_loc, got.seq_lens, got.seeds) == \
            (want.input_ids, want.positions, want.slot_mapping, want.query_start_loc, want.seq_lens, want.seeds), seed
        assert [t[:len(w)] for t, w in zip(got.block_tables, want.block_tables)] == want.block_tables, seed
        assert got.sample_offsets == want.sample_offsets, seed
        for q, smp in zip(o.seqs, o.samples):
            if smp and q.num_output_tokens >= 6:
                s.finish(q, "length")
    assert not pending and not s.has_unfinished() and s.num_preemptions > 0, (seed, steps, s.num_preemptions)
