"""Drive a runner for a few sequences without the engine: contiguous block allocation, prefill in chunks, decode.

Used by `generate` when no engine is needed, by tests, and by benchmarks. Sequence k owns blocks
[k * blocks_per_seq, (k + 1) * blocks_per_seq).
"""
from __future__ import annotations

import numpy as np

from xserv_aot.runtime.batch import BatchDescription, Runner


class Session:
    def __init__(self, runner: Runner, num_seqs: int = 1):
        b = runner.plan.build
        self.runner, self.block_size = runner, b.block_size
        self.blocks_per_seq = b.max_blocks_per_seq
        if num_seqs * self.blocks_per_seq > b.num_blocks:
            raise ValueError(f"{num_seqs} sequences of {b.max_seq_len} tokens need more than {b.num_blocks} KV blocks")
        self.max_seq_len, self.chunk = b.max_seq_len, b.prefill_chunk
        self.lens = [0] * num_seqs

    def table(self, k: int) -> list[int]:
        n = -(-self.lens[k] // self.block_size) if self.lens[k] else 0
        return [k * self.blocks_per_seq + j for j in range(max(n, 1))]

    def step(self, tokens: dict[int, list[int]], need_logits: bool = True, sampling: dict | None = None):
        """Append tokens[k] to sequence k for every k in the dict; returns (sampled ids, logits) per listed seq."""
        batch = BatchDescription([], [], [], [0], [], [], need_logits=need_logits)
        for k, toks in tokens.items():
            start = self.lens[k]
            if start + len(toks) > self.max_seq_len:
                raise ValueError(f"sequence {k} would exceed max_seq_len {self.max_seq_len}")
            self.lens[k] += len(toks)
            for j, tok in enumerate(toks):
                p = start + j
                batch.input_ids.append(int(tok))
                batch.positions.append(p)
                batch.slot_mapping.append((k * self.blocks_per_seq + p // self.block_size) * self.block_size
                                          + p % self.block_size)
            batch.query_start_loc.append(batch.query_start_loc[-1] + len(toks))
            batch.seq_lens.append(self.lens[k])
            batch.block_tables.append(self.table(k))
        if sampling:
            for key, vals in sampling.items():
                setattr(batch, key, list(vals))
        res = self.runner.run(batch)
        return res.sampled_ids, res.logits

    def prefill(self, k: int, prompt: list[int], need_logits: bool = True):
        """Prefill in plan-sized chunks; returns the last chunk's (sampled id, logits row)."""
        out = None
        for i in range(0, len(prompt), self.chunk):
            ids, logits = self.step({k: prompt[i: i + self.chunk]}, need_logits)
            out = (int(ids[0]), None if logits is None else logits[0])
        return out

    def greedy(self, prompt: list[int], max_new: int, k: int = 0, stop_ids=()) -> tuple[list[int], list[np.ndarray]]:
        tok, logits = self.prefill(k, prompt)
        out, all_logits = [tok], [logits]
        while len(out) < max_new and tok not in stop_ids and self.lens[k] < self.max_seq_len:
            ids, lg = self.step({k: [tok]})
            tok = int(ids[0])
            out.append(tok)
            all_logits.append(lg[0])
        return out, all_logits
