"""The persistent decode megakernel (kernels/decode_megakernel.cu): in decode buckets of <= MK_MAX_SEQS seqs every
op from layer 0's input norm to the final norm runs as one launch of build.megakernel_sms blocks (one an SM, all
resident: the runtime checks the GPU), the ops it replaces launch nothing ("fused_into_megakernel"; the NumPy
backend still runs each of them). Used only where the bucket's ops are the standard layer sequence below, the
layer weights sit at one stride and the shapes fit the kernel's shared-memory slots; otherwise the bucket keeps
its per-op kernels and the manifest says why (kernels.megakernel_skipped)."""
from __future__ import annotations

import functools
from typing import Callable

from xserv_aot.plan.kernel_constants import (MK_CONSUMERS, MK_H_SEQ_BYTES, MK_PART_FLOATS, MK_ROW_PAD,
                                             MK_SCALE_FLOATS, MK_SMEM_MAX, MK_STAGE_BYTES, MK_TILE, MK_TRACE)
from xserv_aot.plan.launch_records import f32, i32, kernel, kv, launch, ptr
from xserv_aot.plan.op_records import (AddRmsNorm, Attention, KernelChoice, Linear, Op, QkNormRopeCache, RmsNorm,
                                       SiluMul)
from xserv_aot.plan.signatures import kernel_signatures
from xserv_aot.plan.tensor_parallel import rank_model

MK_MAX_SEQS = 2
MK_GQA = (4,)                    # query heads per kv head with an instantiated kernel
MK_HEAD_DIM = 128
MK_TILE_LOAD = "after"           # where a split's first KV tile is loaded (from L2: prefetched at the layer's
                                 # start): "regs" before the qkv barrier, "after" q, k, v are prepared (kernel
                                 # suffixes "", _tl2); H200: after ("early", _tl3: FP8 only, bf16 2.6% slower)
MK_FP8_TILE_LOAD = "after"       # the same for FP8 weights (H200, session 11: "early" takes FP8 decode_2 at ctx 128 /
                                 # 1024 from 4.24 / 4.49 to 4.10 / 4.37 ms but at 4096 from 5.78 to 6.15; bf16
                                 # decode_1 at 128 4.34 against 4.23)
TILE_LOAD_SUFFIX = {"regs": "", "after": "_tl2", "early": "_tl3"}
MK_PRODUCER_WARPS = 4            # the weight-stream producer: one warp, or a warpgroup (4) whose registers go to
                                 # the consumers (setmaxnreg; H200 decode_1: 4.14 vs 4.52 ms at ctx 128)
MK_FP8_SEQS = (2,)               # bucket sizes whose FP8 plans take the megakernel (H200: decode_2 4.13 vs 4.38 ms
                                 # per-op; decode_1 3.37 vs 3.20: the e4m3 conversions bind the consumer warps)
MK_FP8_TC = False                # FP8 decode_1 through the tensor cores (_f8ct / _f8bt: padded slot rows, mma.sync)
MK_KV_PREFETCH = 0               # the layer-start KV prefetch: 0 per 128-B line, 1 per 256-B row by the copy engine
                                 # (H200: tie; per line with L2 evict_last, session 11: no change, removed)

MK_MAX_STAGES = 5                # H200, decode_1: 6 slots measured 0.1 ms slower than 5 (docs/cuda-notes.md)
MK_L2_AHEAD = 0                  # ring slots the producer prefetches into L2 while every slot holds landed rows
                                 # (H200: 4 / 8 no gain at ctx <= 1024, slower for decode_2 at 4096; cuda-notes)
FUSED = "fused_into_megakernel"
MK_PREFIX = "decode_mk_"
MK_SOURCE = "decode_megakernel.cu"
LAYER_OPS = (Linear, QkNormRopeCache, Attention, Linear, AddRmsNorm, Linear, SiluMul, Linear)
QUANT_SUFFIX = {None: "", "fp8_channel": "_f8c", "fp8_block128": "_f8b"}    # instantiated weight formats
WEIGHT_BYTES = {None: 2, "fp8_channel": 1, "fp8_block128": 1}


def block_threads() -> int:
    """Threads a block of the chosen variant: the consumer warps and the producer warp(s)."""
    return (MK_CONSUMERS + MK_PRODUCER_WARPS) * 32


def tensor_cores(seqs: int, quant: str | None) -> bool:
    """FP8 rows on the tensor cores (the kernel's TC): decode_1 of FP8 plans with MK_FP8_TC."""
    return bool(quant) and seqs == 1 and MK_FP8_TC


def kernel_name(seqs: int, g: int, quant: str | None = None) -> str:
    """The kernel of the variant the constants above choose (NotEligible where kernels/decode_megakernel.cu
    instantiates none)."""
    variant = (TILE_LOAD_SUFFIX[MK_FP8_TILE_LOAD if quant else MK_TILE_LOAD]
               + ("_p4" if MK_PRODUCER_WARPS == 4 else ""))
    name = (f"{MK_PREFIX}m{seqs}_g{g}_hd{MK_HEAD_DIM}{variant}{QUANT_SUFFIX[quant]}"
            + ("t" if tensor_cores(seqs, quant) else ""))
    if name not in instantiated_kernels():
        raise NotEligible(f"{quant or 'bf16'} weights: no kernel of variant {variant or 'default'!r} ({name})")
    return name


@functools.cache
def instantiated_kernels() -> frozenset[str]:
    """The megakernel's `extern "C"` kernels (the MK_KERNEL lines of its source)."""
    return frozenset(kernel_signatures(MK_SOURCE))


class NotEligible(Exception):
    """Why a bucket keeps its per-op kernels (one line)."""


def smem_layout(seqs: int) -> tuple[int, int]:
    """(ring slots, dynamic shared memory bytes) of the kernel for seqs sequences: the GEMV input, partial sums,
    mbarriers, scratch and two layers' FP8 scales first, the ring gets the rest of MK_SMEM_MAX, at most
    MK_MAX_STAGES slots."""
    fixed = seqs * MK_H_SEQ_BYTES + 4 * MK_PART_FLOATS + 64 * 4 + 2 * 4 * MK_SCALE_FLOATS
    stages = min(MK_MAX_STAGES, (MK_SMEM_MAX - fixed) // (MK_STAGE_BYTES + 2 * 8))
    return stages, stages * (MK_STAGE_BYTES + 2 * 8) + fixed


def slot_rows(k: int, wb: int = 2) -> int:
    """Rows of a K-wide matrix of wb-byte weights in one ring slot (the kernel's slot_rows)."""
    r = MK_STAGE_BYTES // (wb * k)
    return 8 if r >= 8 else 4 if r >= 4 else 2 if r >= 2 else 1


def layer_ops(ops: list[Op]) -> tuple[int, int, list[list[Op]]]:
    """(index of layer 0's input norm, index of the final norm, each layer's ops after its input norm)."""
    start = next((i for i, op in enumerate(ops) if isinstance(op, RmsNorm)), None)
    if start is None:
        raise NotEligible("no input rmsnorm")
    layers, i = [], start + 1
    while i + len(LAYER_OPS) < len(ops) and isinstance(ops[i], Linear) and ops[i].weight.endswith(".qkv"):
        group = ops[i:i + len(LAYER_OPS)]
        if not all(isinstance(op, t) for op, t in zip(group, LAYER_OPS)) or not isinstance(ops[i + 8], AddRmsNorm):
            raise NotEligible(f"op {i}: not the standard layer sequence")
        layers.append(group)
        i += len(LAYER_OPS) + 1
    if not layers:
        raise NotEligible("no layers")
    return start, i - 1, layers


def check_layers(ops: list[Op], start: int, layers: list[list[Op]]) -> tuple[dict, str | None]:
    """The buffers every layer reads and writes (the same in each), their consistency, and the one weight format
    of every layer linear (None: bf16; an FP8 scheme with bf16 inputs, W8A16)."""
    norm0 = ops[start]
    qkv, rope, attn, o_proj, post, gate_up, silu, down = layers[0]
    names = {"x": norm0.inp, "h": norm0.out, "qkv": qkv.out, "q": rope.q_out, "attn": attn.out, "o": o_proj.out,
             "gate_up": gate_up.out, "act": silu.out}
    for li, (qkv, rope, attn, o_proj, post, gate_up, silu, down) in enumerate(layers):
        nxt = ops[start + (li + 1) * (len(LAYER_OPS) + 1)]
        ok = (qkv.inp == names["h"] and rope.qkv == qkv.out == names["qkv"] and rope.layer == attn.layer == li
              and attn.q == rope.q_out == names["q"] and o_proj.inp == attn.out == names["attn"]
              and post.residual == names["x"] and post.delta == o_proj.out == names["o"] and post.out == names["h"]
              and gate_up.inp == names["h"] and silu.inp == gate_up.out and down.inp == silu.out == names["act"]
              and down.out == names["o"] and nxt.residual == names["x"] and nxt.delta == names["o"]
              and nxt.out == names["h"])
        if not ok:
            raise NotEligible(f"layer {li}: buffers differ from layer 0's")
        if len({ops[start].eps, post.eps, nxt.eps, rope.eps}) > 1:
            raise NotEligible(f"layer {li}: norms with different eps")
        for lin in (qkv, o_proj, gate_up, down):
            if lin.bias is not None or lin.inp_scale is not None:
                raise NotEligible(f"layer {li}: {lin.weight} has a bias or FP8 inputs")
            if lin.quant not in QUANT_SUFFIX or lin.quant != layers[0][0].quant:
                raise NotEligible(f"layer {li}: {lin.weight} is {lin.quant or 'bf16'}, layer 0's qkv "
                                  f"{layers[0][0].quant or 'bf16'}: one weight format in every linear")
            if lin.quant == "fp8_block128" and (lin.n % 128 or lin.k % 128):
                raise NotEligible(f"layer {li}: {lin.weight} ({lin.n} x {lin.k}) does not tile by 128")
    return names, layers[0][0].quant


# the dtypes of the kernel's layer weights (layer_weights order) a weight format needs
LAYER_DTYPES = {None: ["bfloat16"] * 8}
LAYER_DTYPES.update({q: ["bfloat16", "float8_e4m3fn", "bfloat16", "bfloat16", "float8_e4m3fn", "bfloat16",
                         "float8_e4m3fn", "float8_e4m3fn"] + ["float32"] * 4 for q in ("fp8_channel", "fp8_block128")})


def layer_weights(ops: list[Op], start: int, layers: list[list[Op]]) -> list[list[str | None]]:
    """Per layer, the weights the kernel reads: input norm, qkv, q_norm, k_norm, o_proj, post norm, gate_up, down,
    then (FP8) the scales of qkv, o_proj, gate_up, down."""
    out = []
    for li, (qkv, rope, _, o_proj, post, gate_up, _, down) in enumerate(layers):
        norm = ops[start + li * (len(LAYER_OPS) + 1)]               # layer 0: the rmsnorm, then add_rmsnorms
        w = [norm.weight, qkv.weight, rope.q_norm, rope.k_norm, o_proj.weight, post.weight, gate_up.weight,
             down.weight]
        out.append(w + ([lin.weight_scale for lin in (qkv, o_proj, gate_up, down)] if qkv.quant else []))
    return out


def layer_stride(tensors: dict, per_layer: list[list[str | None]], quant: str | None) -> int:
    """bf16 elements between a layer weight and the same weight of the next layer: one byte stride for every
    weight (a multiple of 4 bytes with FP8: the kernel steps its float32 scales by half of it)."""
    strides, dtypes = set(), LAYER_DTYPES[quant]
    for kind in range(len(per_layer[0])):
        names = [w[kind] for w in per_layer]
        if all(n is None for n in names) and kind in (2, 3):            # no QK norm
            continue
        if any(n is None or tensors[n]["dtype"] != dtypes[kind] for n in names):
            raise NotEligible(f"layer weight {names[0]} missing or not {dtypes[kind]}")
        offs = [tensors[n]["offset"] for n in names]
        strides |= {offs[i + 1] - offs[i] for i in range(len(offs) - 1)}
    if len(strides) > 1 or (strides and min(strides) % (4 if quant else 2)):
        raise NotEligible("layer weights are not at one stride")
    return (strides.pop() if strides else 0) // 2


def layer_scale_floats(m: dict, sms: int, quant: str) -> int:
    """The most FP8 scales one block reads in a layer (the kernel's scale_seg: the scale rows of its rows' 128-row
    blocks, or its rows' channel scales, for qkv, o_proj, gate, up and down)."""
    hidden, inter, nh, nkv, hd = (m[k] for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                                 "head_dim"))
    mats = (((nh + 2 * nkv) * hd, hidden, 0), (hidden, nh * hd, 0), (inter, hidden, 0), (inter, hidden, inter),
            (hidden, inter, 0))
    most = 0
    for b in range(sms):
        n = 0
        for rows, k, off in mats:
            lo, hi = off + b * rows // sms, off + (b + 1) * rows // sms
            if hi > lo:
                n += ((hi - 1) // 128 - lo // 128 + 1) * (k // 128) if quant == "fp8_block128" else hi - lo
        most = max(most, n)
    return most


def check_shapes(m: dict, seqs: int, sms: int, wb: int = 2, tc: bool = False) -> int:
    """smax (splits a sequence's attention may use) if the shapes fit the kernel (tc: the FP8 tensor-core variant,
    every consumer warp a partial of every row, 128-k blocks a warp, padded slot rows)."""
    hidden, inter, nh, nkv, hd = (m[k] for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                                 "head_dim"))
    if hd != MK_HEAD_DIM or nh % nkv or nh // nkv not in MK_GQA:
        raise NotEligible(f"head_dim {hd} / {nh // nkv} query heads a kv head: no instantiated kernel")
    if (slot_rows(hidden, wb) < 2 or wb * max(inter, nh * hd) > MK_STAGE_BYTES
            or 2 * max(hidden, inter, nh * hd) > MK_H_SEQ_BYTES or any(k % (16 // wb) for k in (hidden, inter))):
        raise NotEligible(f"hidden {hidden} / intermediate {inter} do not fit the ring slots")
    for n, k, gate in (((nh + 2 * nkv) * hd, hidden, False), (hidden, nh * hd, False), (inter, hidden, True),
                       (hidden, inter, False)):
        rows = -(-n // sms) * (2 if gate else 1)
        if rows * (MK_CONSUMERS if tc else MK_CONSUMERS // slot_rows(k, wb)) * seqs > MK_PART_FLOATS:
            raise NotEligible(f"{n} x {k}: too many rows a block for the partial sums")
        if tc and (k % (MK_CONSUMERS * 128) or slot_rows(k, wb) * (k * wb + MK_ROW_PAD) > MK_STAGE_BYTES
                   or slot_rows(k, wb) < 2 or k // (MK_CONSUMERS * 128) > 2 * (16 // slot_rows(k, wb))):
            raise NotEligible(f"{n} x {k}: not a whole number of 128-k blocks a warp, padded rows overflow a slot, "
                              "or more than two mma iterations a slot")
    g = nh // nkv
    if 4 * (g * (hd + MK_TILE + MK_CONSUMERS * (hd + 1)) + 2 * hd + 1) > MK_H_SEQ_BYTES:
        raise NotEligible(f"{g} query heads a kv head: the attention scratch does not fit")
    smax = sms // (seqs * nkv)
    if smax < 1:
        raise NotEligible(f"{sms} blocks cannot hold {seqs} x {nkv} attention items")
    return smax


def plan_megakernel(kind: str, ops: list[Op], choices: list[KernelChoice], manifest: dict, m: dict,
                    num_slots: int, max_blocks: int) -> list[KernelChoice]:
    """The bucket's choices with the megakernel in place of the layer ops (NotEligible: why not)."""
    b = manifest["build"]
    sms = int(b.get("megakernel_sms", 0))
    attn0 = next((op for op in ops if isinstance(op, Attention)), None)
    seqs = attn0.num_seqs if attn0 is not None else 0
    if not sms or attn0 is None or attn0.rows != seqs or kind != "decode" or seqs > MK_MAX_SEQS:
        raise NotEligible("not a decode bucket of <= 2 seqs with megakernel_sms set")
    if b.get("tensor_parallel", 1) != 1:
        raise NotEligible("tensor parallel plan")
    start, end, layers = layer_ops(ops)
    names, quant = check_layers(ops, start, layers)
    if quant and seqs not in MK_FP8_SEQS:
        raise NotEligible(f"FP8 weights at {seqs} seqs: the per-op kernels measured faster (MK_FP8_SEQS)")
    smax = check_shapes(m, seqs, sms, WEIGHT_BYTES[quant], tensor_cores(seqs, quant))
    fn = kernel_name(seqs, m["num_heads"] // m["num_kv_heads"], quant)
    if quant and (n := layer_scale_floats(m, sms, quant)) > MK_SCALE_FLOATS:
        raise NotEligible(f"{n} FP8 scales a block and layer: more than the {MK_SCALE_FLOATS} staged in shared "
                          "memory")
    stride = layer_stride(manifest["weights"]["tensors"], layer_weights(ops, start, layers), quant)
    rope, attn, final = layers[0][1], layers[0][2], ops[end]
    stages, smem = smem_layout(seqs)
    scales = [ptr(lin.weight_scale) for lin in (layers[0][i] for i in (0, 3, 5, 7))]     # None for bf16
    args = [ptr(names["x"]), ptr(final.out), ptr(names["qkv"]), ptr(names["attn"]), ptr(names["act"]),
            ptr(ops[start].weight), ptr(layers[0][0].weight), ptr(rope.q_norm), ptr(rope.k_norm),
            ptr(layers[0][3].weight), ptr(layers[0][4].weight), ptr(layers[0][5].weight), ptr(layers[0][7].weight),
            *scales, ptr(final.weight), ("u64", stride), ptr(rope.cos), ptr(rope.sin), ptr(rope.positions),
            ptr(attn.seq_lens), ptr(rope.slot_mapping), ptr(attn.block_tables), kv(0), ptr("attn_part_o"),
            ptr("attn_part_ml"), ptr("attn_counters"), ptr("mk_grid_barrier"), ptr(None), i32(len(layers)),
            i32(m["hidden_size"]), i32(m["intermediate_size"]), i32(m["num_heads"]), i32(m["num_kv_heads"]),
            i32(manifest["kv_cache"]["shape"][3]), i32(max_blocks), i32(num_slots), i32(smax),
            i32(stages), i32(MK_L2_AHEAD), i32(MK_KV_PREFETCH), f32(final.eps), f32(attn.scale)]
    rec = launch(fn, [sms], [block_threads()], smem, args)
    out = list(choices)
    out[start] = kernel(rec)
    for i in range(start + 1, end + 1):
        out[i] = KernelChoice(FUSED, splits=smax if isinstance(ops[i], Attention) else None)
    return out


def add_megakernels(manifest: dict, records: dict, choices: dict, num_slots: int,
                    add_buffer: Callable[[dict, str, list, str], None]) -> dict:
    """The megakernel in every bucket it fits, with its arena buffers: in place of the bucket's per-op kernels, or
    with build.megakernel_max_context N in a copy `<name>_mk` (max_context N, after the original in
    manifest["buckets"]; records / choices get its entry); -> {bucket: why not} for the buckets of <=
    MK_MAX_SEQS seqs that keep per-op kernels only."""
    b = manifest["build"]
    if not b.get("megakernel_sms"):
        return {}
    m, skipped, limit, buckets = rank_model(manifest), {}, int(b.get("megakernel_max_context", 0)), []
    max_blocks = manifest["arena"]["buffers"]["block_tables"]["shape"][1]
    for bk in manifest["buckets"]:
        name = bk["name"]
        buckets.append(bk)
        try:
            mk = plan_megakernel(bk["kind"], records[name], choices[name], manifest, m, num_slots, max_blocks)
        except NotEligible as e:
            if bk["kind"] == "decode" and bk["num_seqs"] <= MK_MAX_SEQS:
                skipped[name] = str(e)
            continue
        if not limit:
            choices[name] = mk
            continue
        copy = f"{name}_mk"
        buckets.append({**bk, "name": copy, "max_context": limit})
        records[copy], choices[copy] = records[name], mk
    manifest["buckets"] = buckets
    if any(c.kernel.startswith(MK_PREFIX) for cs in choices.values() for c in cs):
        add_buffer(manifest, "mk_grid_barrier", [1], "int64")        # zeroed at start, advanced in whole barriers
        sms, layers = manifest["build"]["megakernel_sms"], m["num_layers"]
        add_buffer(manifest, "mk_trace", [sms * layers * MK_TRACE], "int64")     # scripts/megakernel_trace.py
    return skipped
