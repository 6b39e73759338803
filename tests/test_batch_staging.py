"""runtime.batch.stage_inputs, the padding contract both runners use: a hand-padded batch, stale buffers
overwritten, and batches that do not fit refused."""
from __future__ import annotations

import numpy as np
import pytest

from xserv_aot.runtime.batch import BatchDescription, stage_inputs

DTYPES = {"input_ids": np.int32, "positions": np.int32, "slot_mapping": np.int32, "query_start_loc": np.int32,
          "seq_lens": np.int32, "logits_indices": np.int32, "temperature": np.float32, "top_k": np.int32,
          "top_p": np.float32, "seeds": np.int64, "sample_offsets": np.int32}


def buffers(t=8, s=4, max_blocks=3, fill=7):
    """Input buffers larger than the bucket, filled with a stale value."""
    out = {n: np.full([t + 2] if n in ("input_ids", "positions", "slot_mapping") else
                      [s + 3] if n == "query_start_loc" else [s + 2], fill, dtype=d) for n, d in DTYPES.items()}
    out["block_tables"] = np.full((s + 2, max_blocks), fill, np.int32)
    return out


def test_two_sequences_padded_to_a_bucket_of_6_tokens_and_3_seqs():
    b = BatchDescription(input_ids=[11, 12, 13, 14], positions=[0, 1, 2, 5], slot_mapping=[16, 17, 18, 37],
                         query_start_loc=[0, 3, 4], seq_lens=[3, 6], block_tables=[[1], [0, 2]],
                         temperature=[0.5, 0.0], top_k=[3, 0], top_p=[0.9, 1.0], seeds=[5, 2 ** 62], sample_offsets=[0, 4])
    dst = buffers()
    stage_inputs(b, dst, 6, 3)
    assert dst["input_ids"].tolist() == [11, 12, 13, 14, 0, 0, 7, 7, 7, 7]
    assert dst["positions"].tolist() == [0, 1, 2, 5, 0, 0, 7, 7, 7, 7]
    assert dst["slot_mapping"].tolist() == [16, 17, 18, 37, -1, -1, 7, 7, 7, 7]
    assert dst["query_start_loc"].tolist() == [0, 3, 4, 4, 7, 7, 7]
    assert dst["seq_lens"].tolist() == [3, 6, 0, 7, 7, 7]
    assert dst["logits_indices"].tolist() == [2, 3, 0, 7, 7, 7]
    assert dst["block_tables"][:2].tolist() == [[1, 0, 0], [0, 2, 0]]
    assert dst["temperature"][:3].tolist() == [0.5, 0.0, 0.0]
    assert dst["top_k"][:3].tolist() == [3, 0, 0] and dst["top_p"][:3].tolist() == [np.float32(0.9), 1.0, 1.0]
    assert dst["seeds"][:3].tolist() == [5, 2 ** 62, 0] and dst["sample_offsets"][:3].tolist() == [0, 4, 0]


def test_sampling_defaults_and_an_empty_first_sequence():
    b = BatchDescription(input_ids=[9], positions=[3], slot_mapping=[3], query_start_loc=[0, 0, 1], seq_lens=[0, 4],
                         block_tables=[[], [0]])
    dst = buffers()
    stage_inputs(b, dst, 2, 2)
    assert dst["logits_indices"][:2].tolist() == [0, 0]         # an empty query range reads row 0, never row -1
    assert dst["temperature"][:2].tolist() == [0.0, 0.0] and dst["top_p"][:2].tolist() == [1.0, 1.0]
    assert dst["block_tables"][0].tolist() == [0, 0, 0]


@pytest.mark.parametrize("tokens,seqs,table,match", [(3, 1, [0], "does not fit"), (2, 2, [0, 1, 2, 3], "4 blocks")])
def test_batches_that_do_not_fit_are_refused(tokens, seqs, table, match):
    b = BatchDescription(input_ids=[1] * tokens, positions=list(range(tokens)), slot_mapping=[-1] * tokens,
                         query_start_loc=[0, tokens], seq_lens=[tokens], block_tables=[table])
    with pytest.raises(ValueError, match=match):
        stage_inputs(b, buffers(), 2, 1 if seqs == 1 else 2)
