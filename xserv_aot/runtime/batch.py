"""The plain-data batch that the scheduler hands to a runner, and the runner interface every backend implements.

A batch holds `num_seqs` sequences and `num_tokens` new tokens, flattened. Sequence i owns token rows
query_start_loc[i]:query_start_loc[i+1]; after this step its context is seq_lens[i] tokens long (cached + new),
so its new tokens sit at positions seq_lens[i] - n_new .. seq_lens[i] - 1. The runner pads the batch to the
plan's smallest bucket with num_tokens >= batch.num_tokens and num_seqs >= batch.num_seqs; padding token rows get
slot -1 (kernels skip them) and padding sequences get seq_len 0 and an empty query range.

The engine does not rebuild a BatchDescription every step: the scheduler sends a BatchUpdate (what changed: new
rows with their tokens and block table, removed rows, newly allocated blocks, host-sampled tokens, and the tokens
scheduled per row), and runtime.input_batch.InputBatch, which keeps every row's state in persistent arrays,
turns it into this step's BatchDescription of NumPy arrays with a fixed number of vectorized operations.
Fields may be lists or NumPy arrays; block_tables may be a 2-D array [num_seqs, width].
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
    # overlapped steps: prev_rows[i] >= 0 means token i is the previous step's sampled_ids[prev_rows[i]], still on
    # the device (input_ids[i] is a placeholder); empty or -1: input_ids[i] as given
    prev_rows: list[int] = field(default_factory=list)       # [num_tokens]
    # grammar masks applied before sampling (plan op apply_token_bitmask); empty: no row has one, nothing staged
    bitmask_rows: list[int] = field(default_factory=list)    # [num_seqs] 1 = apply token_bitmask[i]
    token_bitmask: "np.ndarray | None" = None                # int32 [num_seqs, ceil(V / 32)] when bitmask_rows

    def block_table_array(self, num_rows: int, width: int) -> np.ndarray:
        """Block tables as int32 [num_rows, width], zero-padded (rows past num_seqs are padding sequences)."""
        out = np.zeros((num_rows, width), dtype=np.int32)
        tables = self.block_tables
        if isinstance(tables, np.ndarray):
            if tables.shape[1] > width:
                raise ValueError(f"block tables are {tables.shape[1]} blocks wide (max {width})")
            out[:len(tables), :tables.shape[1]] = tables
            return out
        for i, row in enumerate(tables):
            if len(row) > width:
                raise ValueError(f"block table of seq {i} has {len(row)} blocks (max {width})")
            out[i, :len(row)] = row
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_context(self) -> int:
        """The longest sequence's context after this step (what context-limited buckets are chosen by)."""
        return max(self.seq_lens, default=0)

    def fill_sampling_defaults(self) -> "BatchDescription":
        n = self.num_seqs
        for name, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("seeds", 0),
                              ("sample_offsets", 0)):
            if len(getattr(self, name)) == 0:
                setattr(self, name, [default] * n)
        return self


NONFINITE_ID = -1                        # the sample op's answer for a row of non-finite logits

# input buffer -> value of padding rows (token rows for the first three, sequence rows for the rest)
TOKEN_PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1}
SEQ_PADDING = {"seq_lens": 0, "logits_indices": 0, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seeds": 0,
               "sample_offsets": 0}


def stage_inputs(batch: BatchDescription, dst: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> None:
    """Write the batch padded to a bucket of num_tokens rows / num_seqs sequences into the input buffers dst (arrays
    with at least that many rows; docs/plan-format.md "Arena buffers"). Padding token rows get slot -1 (no KV write),
    padding sequences an empty query range at the end, seq_len 0 and greedy sampling; a sequence whose block table
    is shorter than the buffer's row has the rest zeroed. Grammar masks (token_bitmask) are written only when a row
    has one (batch.bitmask_rows non-empty); bitmask_rows is always written (0 = no mask). ValueError when the batch does not fit."""
    nt, ns = batch.num_tokens, batch.num_seqs
    if nt > num_tokens or ns > num_seqs:
        raise ValueError(f"batch of {nt} tokens / {ns} seqs does not fit a bucket of {num_tokens} / {num_seqs}")
    batch.fill_sampling_defaults()
    for name, pad in TOKEN_PADDING.items():
        dst[name][:nt] = getattr(batch, name)
        dst[name][nt:num_tokens] = pad
    qsl = dst["query_start_loc"]
    qsl[:ns + 1] = batch.query_start_loc
    qsl[ns + 1:num_seqs + 1] = batch.query_start_loc[-1]
    bt = dst["block_tables"]
    tables = batch.block_tables
    if isinstance(tables, np.ndarray):                   # the persistent batch's [num_seqs, width] array
        if tables.shape[1] > bt.shape[1]:
            raise ValueError(f"block tables are {tables.shape[1]} blocks wide (max {bt.shape[1]})")
        bt[:ns, :tables.shape[1]] = tables
        bt[:ns, tables.shape[1]:] = 0
    else:
        for i, row in enumerate(tables):
            if len(row) > bt.shape[1]:
                raise ValueError(f"block table of seq {i} has {len(row)} blocks (max {bt.shape[1]})")
            bt[i, :len(row)] = row
            bt[i, len(row):] = 0
    prev = np.asarray(batch.prev_rows, dtype=np.int32) if len(batch.prev_rows) else None
    if "prev_rows" in dst:
        dst["prev_rows"][:nt] = prev if prev is not None else -1
        dst["prev_rows"][nt:num_tokens] = -1
    elif prev is not None and (prev >= 0).any():
        raise ValueError("this plan has no resolve_input_ids op (compiled before overlapped steps); recompile it")
    last = np.asarray(batch.query_start_loc[1:], dtype=np.int64) - 1
    values = {"seq_lens": batch.seq_lens, "logits_indices": np.maximum(last, 0), "temperature": batch.temperature,
              "top_k": batch.top_k, "top_p": batch.top_p, "seeds": batch.seeds, "sample_offsets": batch.sample_offsets}
    for name, pad in SEQ_PADDING.items():
        dst[name][:ns] = values[name]
        dst[name][ns:num_seqs] = pad
    masks = len(batch.bitmask_rows) > 0
    if "bitmask_rows" in dst:                            # plans compiled before grammar masks have none
        dst["bitmask_rows"][:ns] = batch.bitmask_rows if masks else 0
        dst["bitmask_rows"][ns:num_seqs] = 0
        if masks and "token_bitmask" in dst:             # host arrays (NumPy backend); CudaRunner copies its own
            dst["token_bitmask"][:ns] = batch.token_bitmask
    elif masks:
        raise ValueError("this plan has no apply_token_bitmask op (compiled before grammar masks); recompile it")


@dataclass
class NewRow:
    """A sequence entering the persistent batch (admitted, or re-admitted after preemption)."""
    row: int                             # persistent row id in [0, max_num_seqs)
    token_ids: list[int]                 # every token so far: prompt + outputs
    num_prompt_tokens: int
    num_computed_tokens: int             # KV already present (prefix cache hits)
    block_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclass
class BatchUpdate:
    """What changed since the previous step, then this step's rows. Applied in field order."""
    new_tokens: list[tuple[int, int]] = field(default_factory=list)   # (row, token): the host sampled it, not the device
    removed: list[int] = field(default_factory=list)                  # rows that left (finished, preempted, aborted)
    new_rows: list[NewRow] = field(default_factory=list)
    new_blocks: list[tuple[int, list[int]]] = field(default_factory=list)   # (row, block ids appended)
    rows: list[int] = field(default_factory=list)                     # this step's rows, in batch order
    num_scheduled: list[int] = field(default_factory=list)            # tokens computed per row this step
    need_logits: bool = False
    reset: bool = False                  # forget every row first (after a failed step)


@dataclass
class StepResult:
    sampled_ids: np.ndarray              # int32 [num_seqs], sampled on the device with the batch's params;
                                         # NONFINITE_ID where the row's logits hold a NaN or Inf
    logits: np.ndarray | None            # float32 [num_seqs, vocab] when batch.need_logits, else None


class Runner(Protocol):
    """A backend that executes plan buckets. Implementations: runtime.numpy_backend, runtime.cuda.runner."""

    plan: "object"                       # xserv_aot.plan.manifest.Plan

    def run(self, batch: BatchDescription) -> StepResult: ...

    def reset_kv(self) -> None: ...      # zero/poison nothing; only for tests that reuse a runner
