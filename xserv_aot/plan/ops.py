"""The ordered op list of one bucket, and the arena buffers those ops read and write (docs/plan-format.md)."""
from __future__ import annotations

import functools

from xserv_aot import fp8
from xserv_aot.config import FP8_W8A16_MAX_ROWS, BuildConfig  # noqa: F401  (tests import it here)
from xserv_aot.model_config import ModelConfig
from xserv_aot.dtypes import FP8
from xserv_aot.plan.op_records import (AddRmsNorm, AllGather, AllReduce, ApplyTokenBitmask, Attention, Embedding,
                                       GatherRows, Linear, Op, QkNormRopeCache, QuantizeFp8, ResolveInputIds, RmsNorm,
                                       Sample, SiluMul)
from xserv_aot.plan.tensor_parallel import local_model



def arena_buffers(m: ModelConfig, b: BuildConfig, quantized: bool = False) -> dict[str, tuple[list[int], str]]:
    """One rank's arena (every rank's is the same): per-rank head / intermediate widths under tensor parallelism;
    quantized: the plan has FP8 weights."""
    t = max(b.prefill_chunk, b.max_num_seqs)     # token rows
    s = b.max_num_seqs                            # sequence rows
    act, tp = b.dtype, b.tensor_parallel
    full_vocab = m.vocab_size
    m = local_model(m, tp)
    shard = {"logits_shard": ([s, full_vocab // tp], "float32")} if tp > 1 else {}
    return {
        "input_ids": ([t], "int32"),
        "positions": ([t], "int32"),
        "slot_mapping": ([t], "int32"),
        "query_start_loc": ([s + 1], "int32"),
        "seq_lens": ([s], "int32"),
        "block_tables": ([s, b.max_blocks_per_seq], "int32"),
        "logits_indices": ([s], "int32"),
        "temperature": ([s], "float32"),
        "top_k": ([s], "int32"),
        "top_p": ([s], "float32"),
        "seeds": ([s], "int64"),
        "sample_offsets": ([s], "int32"),
        "bitmask_rows": ([s], "int32"),
        "prev_rows": ([t], "int32"),
        "x": ([t, m.hidden_size], act),
        "h": ([t, m.hidden_size], act),
        "qkv": ([t, m.q_size + 2 * m.kv_size], act),
        "q": ([t, m.num_heads, m.head_dim], act),
        "attn": ([t, m.q_size], act),
        "o": ([t, m.hidden_size], act),
        "gate_up": ([t, 2 * m.intermediate_size], act),
        "act": ([t, m.intermediate_size], act),
        "hl": ([s, m.hidden_size], act),
        **shard,
        **(fp8_buffers(m, t, b.fp8_w8a16_max_rows) if quantized else {}),
        "logits": ([s, full_vocab], "float32"),
        "sampled_ids": ([s], "int32"),
        "token_bitmask": ([s, bitmask_words(m.vocab_size)], "int32"),   # staged only when a row has a grammar
    }


def fp8_buffers(m: ModelConfig, t: int, w8a16_max_rows: int) -> dict[str, tuple[list[int], str]]:
    """W8A8 activations: a linear's input quantized per row and K-group (packed: [rows, k] and
    [rows, groups] row-major from the buffers' start, docs/plan-format.md "FP8")."""
    if t <= w8a16_max_rows:
        return {}
    width = max(m.hidden_size, m.intermediate_size)
    return {"xq": ([t, width], FP8), "xq_scale": ([t, fp8.groups(width, fp8.BLOCK)], "float32")}


def linear_ops(quant: dict[str, str] | None, rows: int, inp: str, weight: str, out: str, n: int, k: int,
               bias: str | None = None, w8a16_max_rows: int = FP8_W8A16_MAX_ROWS) -> list[Op]:
    """A linear as the plan runs it: bf16; FP8 W8A16 (<= w8a16_max_rows rows); or quantize_fp8 + FP8 W8A8.
    quant: plan weight name -> FP8 scheme, for the weights stored as FP8 (with their scales at NAME.scale)."""
    scheme = (quant or {}).get(weight)
    if scheme is None:
        return [Linear(inp=inp, weight=weight, bias=bias, out=out, rows=rows, n=n, k=k)]
    fields = dict(weight=weight, bias=bias, out=out, rows=rows, n=n, k=k, weight_scale=weight + ".scale", quant=scheme)
    if rows <= w8a16_max_rows:
        return [Linear(inp=inp, **fields)]
    return [QuantizeFp8(inp=inp, out="xq", scale="xq_scale", rows=rows, k=k, group=fp8.act_group(scheme, k)),
            Linear(inp="xq", inp_scale="xq_scale", **fields)]


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


INPUT_BUFFERS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "logits_indices", "temperature", "top_k", "top_p", "seeds", "sample_offsets", "prev_rows",
                 "bitmask_rows")


def bucket_ops(m: ModelConfig, t: int, s: int, tp: int = 1, quant: dict[str, str] | None = None,
               w8a16_max_rows: int = FP8_W8A16_MAX_ROWS) -> list[Op]:
    """Ops for a bucket of t token rows and s sequences, as each of tp ranks runs them: with tp > 1 the shapes are
    a rank's, o_proj and down are followed by an all_reduce, and the vocab-parallel lm_head by an all_gather.
    quant: the FP8 weights' schemes (linear_ops); a tied model with an FP8 head has its own "lm_head" tensor.
    w8a16_max_rows: BuildConfig.fp8_w8a16_max_rows."""
    vocab, tied = m.vocab_size, m.tie_word_embeddings and "lm_head" not in (quant or {})
    lin = functools.partial(linear_ops, quant, w8a16_max_rows=w8a16_max_rows)
    m = local_model(m, tp)
    eps, hd = m.rms_norm_eps, m.head_dim
    h, inter, nqkv = m.hidden_size, m.intermediate_size, m.q_size + 2 * m.kv_size
    heads = dict(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=hd)
    ops: list[Op] = [ResolveInputIds(ids="input_ids", prev_rows="prev_rows", sampled="sampled_ids", rows=t),
                     Embedding(ids="input_ids", table="embed_tokens", out="x", rows=t)]
    for li in range(m.num_layers):
        p = f"layers.{li}."
        if li == 0:
            ops.append(RmsNorm(inp="x", weight=p + "input_norm", out="h", rows=t, eps=eps))
        else:
            ops.append(AddRmsNorm(residual="x", delta="o", weight=p + "input_norm", out="h", rows=t, eps=eps))
        ops += lin(t, "h", p + "qkv", "qkv", nqkv, h, bias=p + "qkv_bias" if m.qkv_bias else None)
        ops.append(QkNormRopeCache(qkv="qkv", positions="positions", slot_mapping="slot_mapping",
                                   q_norm=p + "q_norm" if m.qk_norm else None,
                                   k_norm=p + "k_norm" if m.qk_norm else None, cos="rope_cos", sin="rope_sin",
                                   q_out="q", kv_cache="kv_cache", layer=li, rows=t, eps=eps, **heads))
        ops.append(Attention(q="q", kv_cache="kv_cache", layer=li, query_start_loc="query_start_loc",
                             seq_lens="seq_lens", block_tables="block_tables", out="attn", rows=t, num_seqs=s,
                             scale=hd ** -0.5, **heads))
        ops += lin(t, "attn", p + "o_proj", "o", h, m.q_size)
        ops += [AllReduce(buf="o", rows=t, ranks=tp)] if tp > 1 else []
        ops.append(AddRmsNorm(residual="x", delta="o", weight=p + "post_attn_norm", out="h", rows=t, eps=eps))
        ops += lin(t, "h", p + "gate_up", "gate_up", 2 * inter, h)
        ops.append(SiluMul(inp="gate_up", out="act", rows=t, inter=inter))
        ops += lin(t, "act", p + "down", "o", h, inter)
        ops += [AllReduce(buf="o", rows=t, ranks=tp)] if tp > 1 else []
    ops.append(AddRmsNorm(residual="x", delta="o", weight="final_norm", out="h", rows=t, eps=eps))
    ops.append(GatherRows(inp="h", indices="logits_indices", out="hl", rows=s))
    if tp > 1:
        ops += lin(s, "hl", "lm_head", "logits_shard", vocab // tp, h)
        ops.append(AllGather(inp="logits_shard", out="logits", rows=s, n=vocab // tp, ranks=tp))
    else:
        ops += lin(s, "hl", "embed_tokens" if tied else "lm_head", "logits", vocab, h)
    ops.append(ApplyTokenBitmask(logits="logits", bitmask="token_bitmask", bitmask_rows="bitmask_rows", rows=s,
                                 n=vocab))
    ops.append(Sample(logits="logits", temperature="temperature", top_k="top_k", top_p="top_p", seeds="seeds",
                      sample_offsets="sample_offsets", out="sampled_ids", rows=s))
    return ops


def bucket_shapes(b: BuildConfig) -> list[tuple[str, str, int, int]]:
    """(name, kind, num_tokens, num_seqs) for every bucket; decode buckets hold one token per sequence."""
    out = [(f"decode_{n}", "decode", n, n) for n in b.decode_buckets]
    out += [(f"prefill_{t}", "prefill", t, b.max_num_seqs) for t in b.prefill_buckets]
    return out
