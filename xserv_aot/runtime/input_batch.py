"""The persistent input batch: every running sequence's tokens, block table and sampling params in fixed arrays
indexed by a row id the scheduler assigns, updated by BatchUpdate deltas (vLLM v1's InputBatch idea).

prepare(update) applies the deltas (Python work proportional to what changed) and builds the step's
BatchDescription with a fixed number of NumPy operations; record(sampled) appends the device-sampled token of
every row that sampled, so decode tokens never travel back from the scheduler (a host-sampled token comes back
as BatchUpdate.new_tokens and replaces it).
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
        self._sampling_rows: np.ndarray | None = None         # rows of the last step that sampled

    def apply(self, u: BatchUpdate) -> None:
        if u.reset:
            self.active[:] = False
        for row, tok in u.new_tokens:
            self.token_ids[row, self.num_tokens[row] - 1] = tok
        for row in u.removed:
            self.active[row] = False
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
        self._sampling_rows = rows[seq_lens == self.num_tokens[rows]]
        self._sampled_mask = seq_lens == self.num_tokens[rows]
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return BatchDescription(
            input_ids=self.token_ids[token_row, positions], positions=positions, slot_mapping=slots.astype(np.int32),
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=self.block_table[rows, :width],
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            seeds=self.seeds[rows], sample_offsets=self.num_tokens[rows] - self.num_prompt[rows],
            need_logits=u.need_logits)

    def record(self, sampled_ids: np.ndarray) -> None:
        """After the step: append each sampling row's device-sampled token (sampled_ids[i] is batch row i)."""
        rows = self._sampling_rows
        if rows is None or not len(rows):
            return
        toks = np.asarray(sampled_ids).reshape(-1)[:len(self._sampled_mask)][self._sampled_mask]
        room = self.num_tokens[rows] < self.token_ids.shape[1]   # a row at max_seq_len finishes by length
        self.token_ids[rows[room], self.num_tokens[rows[room]]] = toks[room]
        self.num_tokens[rows[room]] += 1
