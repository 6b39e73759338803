"""Dummy weights on the GPU: fill_normal_bf16 writes each tensor of plan/dummy_weights.py in place; a rank of a
tensor-parallel plan fills the full tensor into a scratch buffer and copies its slices out (tensor_parallel
.shard_copies), so every rank holds exactly its part of the one generator's values. The sharded path is NOT RUN on
a GPU yet (tests/test_cuda_tp.py)."""
from __future__ import annotations

import numpy as np

from xserv_aot.dtypes import ITEMSIZE
from xserv_aot.plan.dummy_weights import tensor_params
from xserv_aot.plan.tensor_parallel import ShardSpec, shard_copies, targets_of
from xserv_aot.plan.weights import rope_tables, weight_specs
from xserv_aot.runtime.cuda.driver import Launch


def fill(dev, fill_fn, ptr: int, seed: int, index: int, shape: list[int]) -> None:
    n = int(np.prod(shape))
    tseed, mean, std = tensor_params(seed, index, shape)
    Launch("fill_normal_bf16", fill_fn, (min(-(-n // 256), 65536), 1, 1), (256, 1, 1), 0,
           [("ptr", ptr), ("u64", n), ("u64", tseed), ("f32", mean), ("f32", std)])(dev.stream)


def upload_dummy_weights(dev, plan, fill_fn, weights_ptr: int, rank: int = 0) -> None:
    seed, table = int(plan.dummy_seed or 0), plan.weights
    specs = {k: ShardSpec.from_dict(v) for k, v in (plan.sharding or {}).items()}
    full = weight_specs(plan.model)
    scratch = None
    if specs:
        itemsize = ITEMSIZE[plan.build.dtype]
        scratch = dev.alloc(max(int(np.prod(shape)) for shape, _ in full.values()) * itemsize)
    for index, (name, (shape, _)) in enumerate(full.items()):
        if not specs or specs[name].dim is None and name not in {s.source for s in specs.values()}:
            fill(dev, fill_fn, weights_ptr + table[name].offset, seed, index, shape)
            continue
        fill(dev, fill_fn, scratch, seed, index, shape)
        for target in targets_of(name, specs):
            dst = weights_ptr + table[target].offset
            for c in shard_copies(specs[target], shape, itemsize, rank):
                dev.dtod_2d(dst + c.dst_offset, c.dst_pitch, scratch + c.src_offset, c.src_pitch, c.width, c.height)
    cos, sin = rope_tables(plan.model, plan.build.max_seq_len)
    dev.htod(weights_ptr + table["rope_cos"].offset, cos)
    dev.htod(weights_ptr + table["rope_sin"].offset, sin)
