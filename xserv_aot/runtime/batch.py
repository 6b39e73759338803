"""The plain-data batch that the scheduler hands to a runner, and the runner interface every backend implements.

A batch holds `num_seqs` sequences and `num_tokens` new tokens, flattened. Sequence i owns token rows
query_start_loc[i]:query_start_loc[i+1]; after this step its context is seq_lens[i] tokens long (cached + new),
so its new tokens sit at positions seq_lens[i] - n_new .. seq_lens[i] - 1. The runner pads the batch to the
plan's smallest bucket with num_tokens >= batch.num_tokens and num_seqs >= batch.num_seqs; padding token rows get
slot -1 (kernels skip them) and padding sequences get seq_len 0 and an empty query range.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class BatchDescription:
    input_ids: list[int]                 # [num_tokens]
    positions: list[int]                 # [num_tokens]
    slot_mapping: list[int]              # [num_tokens], block_id * block_size + offset; -1 = do not write KV
    query_start_loc: list[int]           # [num_seqs + 1], query_start_loc[0] == 0
    seq_lens: list[int]                  # [num_seqs], context length after this step
    block_tables: list[list[int]]        # [num_seqs][<= max_blocks_per_seq]
    # sampling, one entry per sequence; the row sampled is the last new token of each sequence
    temperature: list[float] = field(default_factory=list)   # 0 = greedy
    top_k: list[int] = field(default_factory=list)           # 0 or >= vocab = off
    top_p: list[float] = field(default_factory=list)         # 1.0 = off
    seeds: list[int] = field(default_factory=list)           # 0 <= seed < 2**63
    sample_offsets: list[int] = field(default_factory=list)  # index of the token being generated (RNG counter)
    need_logits: bool = False            # copy float32 logits back to the host
    # grammar masks applied before sampling (plan op apply_token_bitmask); empty: no row has one, nothing staged
    bitmask_rows: list[int] = field(default_factory=list)    # [num_seqs] 1 = apply token_bitmask[i]
    token_bitmask: "np.ndarray | None" = None                # int32 [num_seqs, ceil(V / 32)] when bitmask_rows

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def fill_sampling_defaults(self) -> "BatchDescription":
        n = self.num_seqs
        if not self.temperature:
            self.temperature = [0.0] * n
        if not self.top_k:
            self.top_k = [0] * n
        if not self.top_p:
            self.top_p = [1.0] * n
        if not self.seeds:
            self.seeds = [0] * n
        if not self.sample_offsets:
            self.sample_offsets = [0] * n
        return self


@dataclass
class StepResult:
    sampled_ids: np.ndarray              # int32 [num_seqs], sampled on the device with the batch's params
    logits: np.ndarray | None            # float32 [num_seqs, vocab] when batch.need_logits, else None


class Runner(Protocol):
    """A backend that executes plan buckets. Implementations: runtime.numpy_backend, runtime.cuda.runner."""

    plan: "object"                       # xserv_aot.plan.manifest.Plan

    def run(self, batch: BatchDescription) -> StepResult: ...

    def reset_kv(self) -> None: ...      # zero/poison nothing; only for tests that reuse a runner
