"""Iteration-level continuous batching with chunked prefill and recompute preemption.

Each step: (1) running sequences with one uncomputed token (decodes), oldest first; when one cannot get a KV
block, the newest running sequence not yet scheduled this step is preempted (blocks freed, back to the front of
the waiting queue, recomputed later), possibly itself. (2) running sequences still prefilling, oldest first, and
(3) waiting sequences in arrival order (none when this step preempted), each taking a chunk of what is left of
the token budget `prefill_chunk`, with at most `max_num_seqs` running. A step that carries decodes gives prompts
at most `mixed_prefill_budget` tokens, so a long prompt delays running decodes by one such step, never more. A
sequence that cannot get its blocks while it is the only one holding any can never run: it finishes with an error
instead of deadlocking.

The step goes to the runner side as a BatchUpdate (runtime/batch.py): each running sequence holds a persistent
row id from first schedule until it finishes or is preempted; only new rows carry tokens and block tables, and a
running row sends only the block ids allocated since the last step.

Forks: a sequence added while an unfinished one has the same prompt (parallel samples, n > 1) gets that one as
fork_parent. At admission it waits (admission stops there) until the parent has computed the prompt's full blocks,
then shares them (BlockManager.fork; its new row carries the shared block ids); once the parent is finished it is
allocated like any other.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from xserv_aot.config import BuildConfig
from xserv_aot.engine.block_manager import BlockManager
from xserv_aot.engine.sampler import effective_temperature
from xserv_aot.engine.sequence import Sequence, SequenceStatus
from xserv_aot.runtime.batch import BatchDescription, BatchUpdate, NewRow


@dataclass
class SchedulerOutput:
    update: BatchUpdate
    seqs: list[Sequence]                 # row i of the batch
    num_new_tokens: list[int]
    samples: list[bool]                  # row i completes its sequence's tokens, so its sampled id is a new token
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)   # finished with an error by the scheduler
    batch: BatchDescription | None = None                  # the runner side's view, once prepared

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, build: BuildConfig, enable_prefix_caching: bool = True, device_masks: bool = False):
        self.max_num_seqs = build.max_num_seqs
        self.max_seq_len = build.max_seq_len
        self.token_budget = build.prefill_chunk
        self.mixed_prefill_budget = build.mixed_prefill_budget
        self.block_size = build.block_size
        self.block_manager = BlockManager(build.num_blocks, build.block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # admission order, newest last
        self.num_preemptions = 0
        self._free_rows = deque(range(build.max_num_seqs))
        self._pending = BatchUpdate()              # changes since the last schedule (removed rows, host tokens)
        self.device_masks = device_masks           # grammar masks go to the device (else: host sampling)
        self._by_prompt: dict[int, Sequence] = {}  # hash(prompt) -> the first unfinished sequence with it

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.needs_host_sampling = seq.params.sampled_on_host(self.device_masks)
        key = hash(tuple(seq.prompt_ids))
        first = self._by_prompt.get(key)
        if first is not None and not first.is_finished and first.prompt_ids == seq.prompt_ids and \
                seq.num_prompt_tokens > self.block_size:
            seq.fork_parent = first
        else:
            self._by_prompt[key] = seq
        self.waiting.append(seq)

    def _forget(self, seq: Sequence) -> None:
        key = hash(tuple(seq.prompt_ids))
        if self._by_prompt.get(key) is seq:
            del self._by_prompt[key]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Mark seq finished and release its blocks (no-op when already finished)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
            self._release_row(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.error = reason, error
        self._forget(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_row(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        rows: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        failed: list[Sequence] = []
        budget = self.token_budget
        scheduled: set[int] = set()

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        prompt_budget = self.mixed_prefill_budget if decodes else budget   # prompt tokens this step may take
        for seq in decodes + prefills:
            is_prompt = seq.num_uncomputed_tokens > 1
            if (seq.status is not SequenceStatus.RUNNING or budget == 0 or (is_prompt and prompt_budget == 0)
                    or self._ends_pending(seq)):
                continue
            while not bm.can_append(seq):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                if victim is seq and len(self.running) == 1:
                    self._fail_too_big(seq, failed)
                    break
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.append(seq)
            n = min(seq.num_uncomputed_tokens, budget, prompt_budget if is_prompt else 1)
            rows.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
            if is_prompt:
                prompt_budget -= n

        while (self.waiting and not preempted and min(budget, prompt_budget) > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            parent = seq.fork_parent
            if parent is not None and parent.is_finished:
                parent = seq.fork_parent = None
            if parent is not None:
                if parent.status is not SequenceStatus.RUNNING or not bm.can_fork(parent, seq) or \
                        bm.num_forkable(parent, seq) < (seq.num_tokens - 1) // self.block_size:
                    break                                  # the parent's prompt KV is not computed yet
            elif not bm.can_allocate(seq):
                if self.running:
                    break
                self._fail_too_big(seq, failed)
                continue
            self.waiting.popleft()
            bm.fork(parent, seq) if parent is not None else bm.allocate(seq)
            if seq.num_prompt_cached_tokens is None:
                seq.num_prompt_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget, prompt_budget)
            rows.append((seq, n))
            budget -= n
            prompt_budget -= n
        return self._build(rows, preempted, failed)

    def _ends_pending(self, seq: Sequence) -> bool:
        """Its pending token (overlapped steps) is its last (max_tokens or max_seq_len): nothing more to compute."""
        return bool(seq.num_pending) and (seq.num_output_tokens >= seq.params.max_tokens
                                          or seq.num_tokens >= self.max_seq_len)

    def _fail_too_big(self, seq: Sequence, failed: list[Sequence]) -> None:
        need = self.block_manager.blocks_needed(seq.num_tokens)
        self.finish(seq, "error", f"KV cache too small: request {seq.request_id} needs {need} blocks of "
                                  f"{self.block_size} tokens, the pool has {self.block_manager.num_blocks}")
        failed.append(seq)

    def _release_row(self, seq: Sequence) -> None:
        if seq.row is None:
            return
        p = self._pending
        p.new_tokens = [t for t in p.new_tokens if t[0] != seq.row]
        p.removed.append(seq.row)
        self._free_rows.append(seq.row)
        seq.row = None

    def host_token(self, seq: Sequence, token: int) -> None:
        """The engine sampled seq's last token on the host: the runner side's device sample is replaced."""
        if seq.row is not None:
            self._pending.new_tokens.append((seq.row, int(token)))

    def _build(self, rows, preempted, failed) -> SchedulerOutput:
        u, samples = self._pending, []
        for seq, n in rows:
            if seq.row is None:
                seq.row, p = self._free_rows.popleft(), seq.params
                u.new_rows.append(NewRow(seq.row, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed_tokens,
                                         list(seq.block_table), effective_temperature(p.temperature), int(p.top_k),
                                         float(p.top_p), seq.seed))
                seq.num_blocks_sent = len(seq.block_table)
            elif len(seq.block_table) > seq.num_blocks_sent:
                u.new_blocks.append((seq.row, seq.block_table[seq.num_blocks_sent:]))
                seq.num_blocks_sent = len(seq.block_table)
            u.rows.append(seq.row)
            u.num_scheduled.append(n)
            samples.append(seq.num_computed_tokens + n == seq.num_tokens)
            u.need_logits |= samples[-1] and seq.needs_host_sampling
        self._pending = BatchUpdate()
        return SchedulerOutput(u, [s for s, _ in rows], [n for _, n in rows], samples, preempted, failed)

    def commit(self, out: SchedulerOutput) -> None:
        """After the runner ran out.batch: advance computed tokens and register newly full blocks."""
        self.advance(out)
        self.cache(out.seqs)

    def advance(self, out: SchedulerOutput) -> None:
        """Once out.batch is launched: its tokens count as computed."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n

    def cache(self, seqs: list[Sequence]) -> None:
        """Register newly full computed blocks; every token below num_computed_tokens must be known by now."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_blocks(seq)

    def recover(self, failed: list[Sequence]) -> None:
        """After a failed step: `failed` end (status only, their finish_reason is the caller's); every other
        sequence goes back to waiting (running ones first, in order) to be recomputed on a reset block pool."""
        dead = {id(s) for s in failed}
        for seq in failed:
            seq.status = SequenceStatus.FINISHED
            self._forget(seq)
        survivors = [s for s in self.running + list(self.waiting) if id(s) not in dead and not s.is_finished]
        for seq in survivors + failed:
            seq.row = None
        for seq in survivors:
            seq.status = SequenceStatus.WAITING
            seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
        self.running, self.waiting = [], deque(survivors)
        self.block_manager.reset()
        self._free_rows = deque(range(self.max_num_seqs))
        self._pending = BatchUpdate(reset=True)
