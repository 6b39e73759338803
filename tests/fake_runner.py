"""A fake Runner for engine tests that really goes through the paged KV layout, plus a tiny fake tokenizer.

FakeRunner keeps a KV pool of token ids (and their positions) of shape [num_blocks * block_size]. Each step it
writes every input token at its slot_mapping entry, then reads each sequence's whole context back ONLY through
block_tables/seq_lens; its logits are a deterministic function of that context (normal noise seeded by a hash
of it), and sampled_ids follow the plan's `sample` op on those logits. So a wrong block table, slot mapping,
prefix-cache reuse or preemption bug changes the generated tokens. It also asserts the batch contract.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.sampler import draw, sample_token
from xserv_aot.runtime.batch import BatchDescription, StepResult


def context_logits(context: list[int], vocab_size: int) -> np.ndarray:
    digest = hashlib.blake2b(np.asarray(context, dtype="<i8").tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return (rng.standard_normal(vocab_size) * 2.0).astype(np.float32)


def reference_generate(prompt: list[int], params: SamplingParams, seed: int, vocab_size: int,
                       eos_token_ids=()) -> list[int]:
    """What a correct engine must produce for one request on FakeRunner, computed without any paging."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        logits = context_logits(prompt + out, vocab_size)
        if params.needs_host_sampling:
            tok, _ = sample_token(logits, params, prompt, out, seed, len(out))
        else:
            tok = draw(logits, params.temperature, params.top_k, params.top_p, 0.0, seed, len(out))
        out.append(tok)
        if (tok in eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            break
    return out


class FakeRunner:
    def __init__(self, build: BuildConfig, vocab_size: int = 50, eos_token_ids=(), fail_when=None):
        self.build = build.validate()
        self.vocab_size = vocab_size
        self.plan = SimpleNamespace(build=self.build,
                                    model=SimpleNamespace(vocab_size=vocab_size, eos_token_ids=list(eos_token_ids)))
        self.fail_when = fail_when            # callable(batch) -> bool: raise RuntimeError for that step
        self.batches: list[BatchDescription] = []
        self.last_sampled = np.zeros(build.max_num_seqs, dtype=np.int32)   # what sampled_ids holds on a device
        self.reset_kv()

    def reset_kv(self) -> None:
        n = self.build.num_blocks * self.build.block_size
        self.kv_tokens = np.full(n, -1, dtype=np.int64)
        self.kv_pos = np.full(n, -1, dtype=np.int64)

    def _check(self, b: BatchDescription) -> None:
        bld, bs = self.build, self.build.block_size
        n, s = b.num_tokens, b.num_seqs
        assert 0 < n <= bld.prefill_chunk and 0 < s <= bld.max_num_seqs, (n, s)
        assert len(b.positions) == len(b.slot_mapping) == n
        assert len(b.query_start_loc) == s + 1 and b.query_start_loc[0] == 0 and b.query_start_loc[-1] == n
        for name in ("temperature", "top_k", "top_p", "seeds", "sample_offsets", "block_tables"):
            assert len(getattr(b, name)) == s, name
        written: dict[int, int] = {}
        for i in range(s):
            lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
            bt, L = list(b.block_tables[i]), int(b.seq_lens[i])
            assert hi > lo and L <= bld.max_seq_len and len(bt) <= bld.max_blocks_per_seq
            assert -(-L // bs) <= len(bt) and all(0 <= x < bld.num_blocks for x in bt)
            for j, r in enumerate(range(lo, hi)):
                p = L - (hi - lo) + j
                assert b.positions[r] == p, (i, r, b.positions[r], p)
                assert b.slot_mapping[r] == bt[p // bs] * bs + p % bs, (i, r)
                written[bt[p // bs]] = i
        for i, bt in enumerate(b.block_tables):
            for blk in list(bt)[:-(-int(b.seq_lens[i]) // bs)]:          # past seq_len: padding or not yet used
                assert written.get(blk, i) == i, f"seq {i} shares block {blk} that seq {written[blk]} writes"

    def run(self, batch: BatchDescription) -> StepResult:
        self._check(batch)
        self.batches.append(batch)
        if self.fail_when is not None and self.fail_when(batch):
            raise RuntimeError("injected runner failure")
        bs = self.build.block_size
        prev = batch.prev_rows if len(batch.prev_rows) else [-1] * batch.num_tokens
        for tok, p, pos, slot in zip(batch.input_ids, prev, batch.positions, batch.slot_mapping):
            if slot >= 0:               # like resolve_input_ids: a pending token comes from the last sampled ids
                self.kv_tokens[slot], self.kv_pos[slot] = (self.last_sampled[p] if p >= 0 else tok), pos
        logits, sampled = [], []
        for i in range(batch.num_seqs):
            p = np.arange(batch.seq_lens[i])
            slots = np.asarray(batch.block_tables[i])[p // bs] * bs + p % bs
            assert (self.kv_pos[slots] == p).all(), f"seq {i}: KV pool holds positions {self.kv_pos[slots]}"
            row = context_logits(self.kv_tokens[slots].tolist(), self.vocab_size)
            logits.append(row)
            sampled.append(draw(row, float(batch.temperature[i]), int(batch.top_k[i]), float(batch.top_p[i]), 0.0,
                                int(batch.seeds[i]), int(batch.sample_offsets[i])))
        self.last_sampled = np.asarray(sampled, dtype=np.int32)
        return StepResult(self.last_sampled.copy(), np.stack(logits) if batch.need_logits else None)

    def launch(self, batch: BatchDescription) -> StepResult:
        return self.run(batch)

    def wait(self, handle: StepResult) -> StepResult:
        return handle


PIECES = [c for c in "abcdefghijklmnopqrstuvwxyz"] + ["th", "e ", "ing", " the", "!", "?", ". ", "xy", "z\n"]


class FakeTokenizer:
    """Token id i decodes to PIECES[i % len(PIECES)]; eos ids decode to "" when skipping special tokens."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = list(eos_token_ids)

    def piece(self, i: int) -> str:
        return PIECES[i % len(PIECES)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if (skip_special_tokens and i in self.eos_token_ids) else self.piece(i) for i in ids)


class FakeDetokenizer:
    def __init__(self, tokenizer: FakeTokenizer):
        self.tokenizer = tokenizer

    def add(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def flush(self) -> str:
        return ""


class FaultyRunner:
    """Wraps a runner and raises RuntimeError("injected fault at run k") instead of running chosen calls.

    Calls are counted from 0. A call fails when its index is in fail_calls, when `always` is set, or while
    `fail_next` > 0 (decremented per failure; settable from another thread while the engine is idle).
    bad_result_calls: run normally but return a StepResult without logits, so postprocess fails mid-way.
    remote_methods: what a test may call across the engine process boundary (engine.call_runner).
    """
    remote_methods = ("fail_next_calls", "num_failures")

    def __init__(self, inner, fail_calls=(), always: bool = False, bad_result_calls=()):
        self.inner, self.plan = inner, inner.plan
        self.fail_calls, self.bad_result_calls = set(fail_calls), set(bad_result_calls)
        self.always, self.fail_next = always, 0
        self.calls = self.failures = 0

    def run(self, batch: BatchDescription) -> StepResult:
        k = self.calls
        self.calls += 1
        if self.always or k in self.fail_calls or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            self.failures += 1
            raise RuntimeError(f"injected fault at run {k}")
        result = self.inner.run(batch)
        if k in self.bad_result_calls:
            return StepResult(result.sampled_ids, None)
        return result

    def reset_kv(self) -> None:
        self.inner.reset_kv()

    def launch(self, batch: BatchDescription) -> StepResult:
        return self.run(batch)

    def wait(self, handle: StepResult) -> StepResult:
        return handle

    def fail_next_calls(self, n: int) -> None:
        self.fail_next = n

    def num_failures(self) -> int:
        return self.failures
