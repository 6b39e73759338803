"""plans/h200.build.json's prefill buckets up to 8192 tokens: one step takes a whole 8192-token chunk when no
decode runs, mixed steps keep mixed_prefill_tokens, the bucket for a batch is the smallest that holds it, and
Qwen3-8B's weights + arena (sized by the largest bucket) + KV pool fit an H200 with room for the CUDA context."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.model_config import model_config_from_hf
from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.scheduler import Scheduler
from xserv_aot.engine.sequence import Sequence
from xserv_aot.plan.manifest import layout
from xserv_aot.plan.ops import arena_buffers, bucket_shapes
from xserv_aot.plan.weights import weight_specs

ROOT = Path(__file__).resolve().parents[1]
H200_BYTES = 139 << 30            # what cuMemGetInfo reports free on an idle H200 is about 139 GiB
HEADROOM = 8 << 30                # CUDA context, cubins, CUTLASS / attention workspaces, graphs


def h200_build() -> BuildConfig:
    return BuildConfig.from_dict(json.loads((ROOT / "plans" / "h200.build.json").read_text())).validate()


def test_prefill_buckets_reach_8192_and_mixed_steps_keep_their_budget():
    b = h200_build()
    assert {4096, 8192} <= set(b.prefill_buckets) and b.prefill_chunk == 8192
    assert b.mixed_prefill_budget == b.mixed_prefill_tokens == 512
    names = {name: (t, s) for name, kind, t, s in bucket_shapes(b) if kind == "prefill"}
    assert names["prefill_8192"] == (8192, b.max_num_seqs) and names["prefill_4096"] == (4096, b.max_num_seqs)


def test_a_long_prompt_takes_8192_tokens_alone_and_512_beside_decodes():
    b = h200_build()
    s = Scheduler(b)
    short = Sequence("short", [5] * 10, SamplingParams(), seed=0)
    s.add(short)
    out = s.schedule()
    assert out.num_new_tokens == [10]
    s.commit(out)
    short.append_token(7)
    long = Sequence("long", list(range(3, 8003)), SamplingParams(), seed=0)
    s.add(long)
    out = s.schedule()                                # short decodes: the prompt gets the mixed budget
    assert out.seqs == [short, long] and out.num_new_tokens == [1, 512]
    s.commit(out)
    short.append_token(7)
    s.finish(short, "stop")
    out = s.schedule()                                # alone: the rest of the prompt in one 8192 bucket step
    assert out.seqs == [long] and out.num_new_tokens == [8000 - 512]


def test_qwen3_8b_fits_an_h200_at_the_largest_bucket():
    b = h200_build()
    m = model_config_from_hf(json.loads((ROOT / "plans" / "qwen3-8b.config.json").read_text()))
    weights = sum(int(np.prod(shape)) for shape, _ in weight_specs(m).values()) * 2
    _, arena = layout(arena_buffers(m, b))
    kv = b.num_blocks * b.block_size * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    assert arena < 2 << 30, f"arena {arena / 2**30:.2f} GiB"
    total = weights + arena + kv
    assert total + HEADROOM <= H200_BYTES, f"{total / 2**30:.1f} GiB + headroom over an H200"
