"""The persistent input batch: every running sequence's tokens, block table and sampling params in fixed arrays
indexed by a row id the scheduler assigns, updated by BatchUpdate deltas (vLLM v1's InputBatch idea).

prepare(update) applies the deltas (Python work proportional to what changed) and builds the step's
BatchDescription with a fixed number of NumPy operations. launched() appends a placeholder for every row that
samples in that step; resolve(record, sampled_ids) fills them in once the step's result is on the host, so decode
tokens never travel back from the scheduler (a host-sampled token comes back as BatchUpdate.new_tokens).
Overlapped steps: a step prepared while the previous one is still running takes each pending token from the
device (prev_rows[i] = the row's index in the previous batch; the plan's resolve_input_ids op reads sampled_ids).
"""
from __future__ import annotations

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.runtime.batch import BatchDescription, BatchUpdate


class InputBatch:
    def __init__(self, build: BuildConfig):
        n, self.block_size = build.max_num_seqs, build.block_size
        self.token_ids = np.zeros((n, build.max_seq_len), dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int32)         # tokens known per row
        self.num_prompt = np.zeros(n, dtype=np.int32)
        self.num_computed = np.zeros(n, dtype=np.int32)       # tokens whose KV exists (after the last step)
        self.block_table = np.zeros((n, build.max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(n, dtype=np.int32)
        self.temperature = np.zeros(n, dtype=np.float64)      # float64: exactly what the params say
        self.top_k = np.zeros(n, dtype=np.int32)
        self.top_p = np.ones(n, dtype=np.float64)
        self.seeds = np.zeros(n, dtype=np.int64)
        self.active = np.zeros(n, dtype=bool)
        self.generation = np.zeros(n, dtype=np.int64)         # bumped when a row gets a new sequence
        self.pending_pos = np.full(n, -1, dtype=np.int32)     # position of the row's unresolved token, or -1
        self.pending_idx = np.full(n, -1, dtype=np.int32)     # its index in the last launched batch
        self._rows = self._sampling = None                    # the last prepared step

    def apply(self, u: BatchUpdate) -> None:
        if u.reset:
            self.active[:] = False
            self.pending_pos[:] = -1
        for row, tok in u.new_tokens:
            self.token_ids[row, self.num_tokens[row] - 1] = tok
        for row in u.removed:
            self.active[row] = False
            self.pending_pos[row] = -1
        for r in u.new_rows:
            assert not self.active[r.row], f"row {r.row} is in use"
            n, nb = len(r.token_ids), len(r.block_ids)
            self.token_ids[r.row, :n] = r.token_ids
            self.block_table[r.row, :nb] = r.block_ids
            self.num_tokens[r.row], self.num_prompt[r.row], self.num_computed[r.row] = n, r.num_prompt_tokens, \
                r.num_computed_tokens
            self.num_blocks[r.row] = nb
            self.temperature[r.row], self.top_k[r.row], self.top_p[r.row] = r.temperature, r.top_k, r.top_p
            self.seeds[r.row] = r.seed
            self.active[r.row] = True
            self.generation[r.row] += 1
        for row, blocks in u.new_blocks:
            nb = self.num_blocks[row]
            self.block_table[row, nb:nb + len(blocks)] = blocks
            self.num_blocks[row] = nb + len(blocks)

    def prepare(self, u: BatchUpdate) -> BatchDescription:
        """Apply u and return this step's batch (rows in u.rows order); advances num_computed."""
        self.apply(u)
        rows = np.asarray(u.rows, dtype=np.int64)
        n = np.asarray(u.num_scheduled, dtype=np.int32)
        assert self.active[rows].all(), "a scheduled row is not in the batch"
        start = self.num_computed[rows]
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        token_row = np.repeat(rows, n)
        positions = (np.arange(qsl[-1], dtype=np.int32) - np.repeat(qsl[:-1] - start, n)).astype(np.int32)
        bs = self.block_size
        slots = self.block_table[token_row, positions // bs] * bs + positions % bs
        seq_lens = start + n
        self.num_computed[rows] = seq_lens
        self._rows, self._sampling = rows, seq_lens == self.num_tokens[rows]
        pending = positions == self.pending_pos[token_row]
        prev_rows = np.where(pending, self.pending_idx[token_row], -1).astype(np.int32)
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return BatchDescription(
            input_ids=self.token_ids[token_row, positions], positions=positions, slot_mapping=slots.astype(np.int32),
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=self.block_table[rows, :width],
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            seeds=self.seeds[rows], sample_offsets=self.num_tokens[rows] - self.num_prompt[rows],
            need_logits=u.need_logits, prev_rows=prev_rows)

    def launched(self) -> tuple:
        """The last prepared step is running: each sampling row gets a placeholder for its token.
        Returns the record resolve() needs: (rows, batch indices, positions, generations)."""
        idx = np.flatnonzero(self._sampling).astype(np.int32)
        rows = self._rows[idx]
        room = self.num_tokens[rows] < self.token_ids.shape[1]   # a row at max_seq_len finishes by length
        rows, idx = rows[room], idx[room]
        pos = self.num_tokens[rows].copy()
        self.token_ids[rows, pos] = 0
        self.num_tokens[rows] += 1
        self.pending_pos[:] = -1                              # only the latest step's tokens are on the device
        self.pending_pos[rows], self.pending_idx[rows] = pos, idx
        return rows, idx, pos, self.generation[rows].copy()

    def resolve(self, record: tuple, sampled_ids: np.ndarray) -> None:
        """That step's result is here: its tokens replace the placeholders of rows still held by the same sequence."""
        rows, idx, pos, gen = record
        keep = self.generation[rows] == gen
        rows, idx, pos = rows[keep], idx[keep], pos[keep]
        self.token_ids[rows, pos] = np.asarray(sampled_ids).reshape(-1)[idx]
        done = self.pending_pos[rows] == pos
        self.pending_pos[rows[done]] = -1

    def record(self, sampled_ids: np.ndarray) -> None:
        """Non-overlapped: launched() and resolve() at once."""
        self.resolve(self.launched(), sampled_ids)
