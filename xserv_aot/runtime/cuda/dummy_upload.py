"""Dummy weights on the GPU: fill_normal_bf16 writes each tensor of plan/dummy_weights.py in place; a rank of a
tensor-parallel plan fills the full tensor into a scratch buffer and copies its slices out (tensor_parallel
.shard_copies), so every rank holds exactly its part of the one generator's values. The sharded path is NOT RUN on
a GPU yet (tests/test_cuda_tp.py). An FP8 weight (plans compiled with --quantization fp8, never sharded) is filled in
float32 into a scratch buffer and quantized at its scheme by quantize_weight_fp8 (kernels/gemv_fp8.cu), the values
plan/dummy_weights.dummy_plan_tensors gives on the host."""
from __future__ import annotations

import numpy as np

from xserv_aot.dtypes import ITEMSIZE
from xserv_aot import fp8
from xserv_aot.plan.dummy_weights import tensor_params
from xserv_aot.plan.quantize import scale_name
from xserv_aot.plan.tensor_parallel import ShardSpec, shard_copies, targets_of
from xserv_aot.plan.weights import rope_tables, weight_specs
from xserv_aot.runtime.cuda.driver import Launch


def fill(dev, fill_fn, ptr: int, seed: int, index: int, shape: list[int]) -> None:
    n = int(np.prod(shape))
    tseed, mean, std = tensor_params(seed, index, shape)
    Launch("fill_normal_bf16", fill_fn, (min(-(-n // 256), 65536), 1, 1), (256, 1, 1), 0,
           [("ptr", ptr), ("u64", n), ("u64", tseed), ("f32", mean), ("f32", std)])(dev.stream)


def fill_fp8(dev, func, scratch: int, seed: int, index: int, shape: list[int], dst: int, dst_scale: int,
             scheme: str) -> None:
    """The dummy float32 values of tensor `index` quantized into an e4m3 weight and its scales (fp8.quantize_weight)."""
    n, k = shape
    tseed, mean, std = tensor_params(seed, index, shape)
    Launch("fill_normal_f32", func("fill_normal_f32"), (min(-(-(n * k) // 256), 65536), 1, 1), (256, 1, 1), 0,
           [("ptr", scratch), ("u64", n * k), ("u64", tseed), ("f32", mean), ("f32", std)])(dev.stream)
    br, bc = (1, k) if scheme == fp8.CHANNEL else (fp8.BLOCK, fp8.BLOCK)
    Launch("quantize_weight_fp8", func("quantize_weight_fp8"), (-(-n // br), -(-k // bc), 1), (256, 1, 1), 0,
           [("ptr", scratch), ("ptr", dst), ("ptr", dst_scale), ("i32", n), ("i32", k), ("i32", br),
            ("i32", bc)])(dev.stream)


def upload_fp8_plan(dev, plan, fill_fn, func, weights_ptr: int) -> None:
    """An FP8 plan (one rank): FP8 weights quantized on the device from float32 dummy values, the others as bf16."""
    seed, table, schemes, full = int(plan.dummy_seed or 0), plan.weights, plan.fp8_schemes, weight_specs(plan.model)
    at = lambda name: weights_ptr + table[name].offset          # noqa: E731
    scratch = dev.alloc(max(int(np.prod(shape)) for name, (shape, _) in full.items()
                            if name in schemes or name == "embed_tokens") * 4)
    for index, (name, (shape, _)) in enumerate(full.items()):
        if name in schemes:
            fill_fp8(dev, func, scratch, seed, index, shape, at(name), at(scale_name(name)), schemes[name])
        else:
            fill(dev, fill_fn, at(name), seed, index, shape)
        if name == "embed_tokens" and "lm_head" in schemes and "lm_head" not in full:    # tied head, FP8
            fill_fp8(dev, func, scratch, seed, index, shape, at("lm_head"), at(scale_name("lm_head")),
                     schemes["lm_head"])
    dev.sync()
    dev.free(scratch)


def upload_dummy_weights(dev, plan, fill_fn, weights_ptr: int, rank: int = 0, func=None) -> None:
    """func(name) -> kernel function: the FP8 kernels of an FP8 plan."""
    seed, table = int(plan.dummy_seed or 0), plan.weights
    specs = {k: ShardSpec.from_dict(v) for k, v in (plan.sharding or {}).items()}
    full = weight_specs(plan.model)
    if plan.fp8_schemes:
        if specs or func is None:
            raise ValueError("dummy FP8 weights need a one-rank plan and the runner's kernel lookup (func)")
        upload_fp8_plan(dev, plan, fill_fn, func, weights_ptr)
        full = {}
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
