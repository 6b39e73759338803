"""`scripts/bench_kernels.py prefill-elementwise [--rows 2048,4096,8192]`: the row-wise kernels of a prefill
chunk at the Qwen3-8B shape (add_rmsnorm, rmsnorm, silu_mul, qk_norm_rope_cache), launched with the plan's
geometry (plan.elementwise_plan's launch builders), outputs poisoned and checked against torch float32 (the rope
kernel: every q row and KV slot written, finite), timed in a CUDA graph. GB/s counts each kernel's reads + writes
once, against the 4.28 TB/s copy ceiling (read + write) of docs/cuda-notes.md."""
from __future__ import annotations

from dataclasses import replace

import torch

from xserv_aot.plan import elementwise_plan as ew
from xserv_aot.plan import row_kernels as rk
from xserv_aot.plan.op_records import AddRmsNorm, QkNormRopeCache, RmsNorm, SiluMul
from xserv_aot.runtime.cuda.driver import Launch

COPY_GBS = 4280.0
L2_BYTES = 60 << 20
H, INTER, NH, NKV, HD, EPS = 4096, 12288, 32, 8, 128, 1e-6


def packed(rec, bufs: dict, kv_ptr: int) -> list:
    out = []
    for kind, val in rec.args:
        if kind == "ptr":
            out.append(("ptr", bufs[val].data_ptr() if val is not None else 0))
        elif kind == "kv":
            out.append(("ptr", kv_ptr))
        else:
            out.append((kind, val))
    return out


def cases(M: int, gen):
    """[(name, op, tensors, bytes, check(tensors) -> rel. error, names of outputs to poison, reset(tensors) before
    each variant or None)]; bytes: cos + sin rows count once for the rope kernel."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    def rms(x, w):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()

    x, d, w = randn(M, H), randn(M, H), randn(H, scale=0.2).add_(1)
    x0 = x.clone()                     # add_rmsnorm updates its residual in place
    add = dict(res=x, delta=d, w=w, out=torch.empty(M, H, device="cuda", dtype=torch.bfloat16))
    summed = (x0.float() + d.float()).bfloat16()
    yield ("add_rmsnorm", AddRmsNorm(M, residual="res", delta="delta", weight="w", out="out", eps=EPS), add,
           4 * M * H * 2, lambda t: max(err(t["out"], rms(summed, w)), err(t["res"], summed.float())), ("out",),
           lambda t: t["res"].copy_(x0))
    norm = dict(inp=randn(M, H), w=w, out=torch.empty(M, H, device="cuda", dtype=torch.bfloat16))
    yield ("rmsnorm", RmsNorm(M, inp="inp", weight="w", out="out", eps=EPS), norm, 2 * M * H * 2,
           lambda t: err(t["out"], rms(t["inp"], w)), ("out",), None)
    gu = randn(M, 2 * INTER)
    silu = dict(inp=gu, out=torch.empty(M, INTER, device="cuda", dtype=torch.bfloat16))
    g, u = gu[:, :INTER].float(), gu[:, INTER:].float()
    yield ("silu_mul", SiluMul(M, inp="inp", out="out", inter=INTER), silu, 3 * M * INTER * 2,
           lambda t: err(t["out"], torch.nn.functional.silu(g) * u), ("out",), None)
    slots = M + 64
    pos = torch.arange(M, device="cuda", dtype=torch.int32)
    ang = pos[:, None].float() * (1e6 ** (-torch.arange(HD // 2, device="cuda").float() / (HD // 2)))
    rope = dict(qkv=randn(M, (NH + 2 * NKV) * HD), positions=pos, slot_mapping=pos.clone(), q_norm=w[:HD],
                k_norm=w[HD:2 * HD], cos=ang.cos(), sin=ang.sin(),
                q_out=torch.empty(M, NH * HD, device="cuda", dtype=torch.bfloat16),
                kv=torch.empty(2, slots, NKV, HD, device="cuda", dtype=torch.bfloat16))
    op = QkNormRopeCache(M, qkv="qkv", positions="positions", slot_mapping="slot_mapping", q_norm="q_norm",
                         k_norm="k_norm", cos="cos", sin="sin", q_out="q_out", kv_cache="kv", layer=0, num_heads=NH,
                         num_kv_heads=NKV, head_dim=HD, eps=EPS)

    def rope_check(t):
        q, kv = t["q_out"].float(), t["kv"][:, :M].float()
        return 0.0 if torch.isfinite(q).all() and torch.isfinite(kv).all() else float("inf")
    yield ("qk_norm_rope_cache", op, rope, 2 * M * (NH + 2 * NKV) * HD * 2 + M * HD * 4, rope_check,
           ("q_out", "kv"), None)


def err(out, ref) -> float:
    out = out.float()
    return float("inf") if not torch.isfinite(out).all() else float((out - ref).norm() / ref.norm())


ROPE_VARIANTS = [("qk_norm_rope_cache", 4), ("qk_norm_rope_cache_vec", 4), ("qk_norm_rope_cache_vec", 8),
                 ("qk_norm_rope_cache_vec", 2)]                # (kernel, warps a block); the plan's is marked
NORM_VARIANTS = [0, 1]                  # norm_threads few_from: 0 one chunk a thread, 1 fewest threads a row
SILU_VARIANTS = [4096, 1056, None]      # silu_mul grid caps (None: one chunk a thread)
ROWS_NORM = [(k, ef) for ef in (False, True) for k in rk.NORM_KS]           # rows_prefill.cu variants
ROWS_SILU = [(u, t, ef) for ef in (False, True) for u, t in ((2, 256), (3, 256), (6, 256), (3, 512), (6, 128))]
ROWS_ROPE = [(w, ef) for ef in (False, True) for w in (4, 8, 16)]


def launches_of(op, num_slots: int, rows_plan: bool):
    """[(label, launch record)]: the plan's launch first (marked), then the variants; rows_plan: the plan uses
    rows_prefill.cu at this size (prefill_row_kernels auto)."""
    if isinstance(op, (AddRmsNorm, RmsNorm)):
        recs = [ew.norm_launch(op, H, few_from=f).launch[0] for f in NORM_VARIANTS]
        recs += [rk.norm_rows_launch(op, H, k=k, ef=ef).launch[0] for k, ef in ROWS_NORM]
        if isinstance(op, AddRmsNorm):                  # the software f2bf twin (the conversion's share)
            rec = rk.norm_rows_launch(op, H, k=4, ef=False).launch[0]
            recs.append(replace(rec, fn=rec.fn + "_sw"))
        plan = rk.norm_rows_launch(op, H).launch[0] if rows_plan else ew.norm_launch(op, H).launch[0]
    elif isinstance(op, SiluMul):
        recs = [ew.silu_mul_launch(op, cap).launch[0] for cap in SILU_VARIANTS]
        recs += [rk.silu_rows_launch(op, u, t, ef).launch[0] for u, t, ef in ROWS_SILU]
        rec = rk.silu_rows_launch(op, 3, 256, False).launch[0]
        recs.append(replace(rec, fn=rec.fn + "_sw"))
        plan = rk.silu_rows_launch(op).launch[0] if rows_plan else ew.silu_mul_launch(op).launch[0]
    else:
        recs = [ew.qk_rope_launch(op, HD, NH, NKV, num_slots, fn, w).launch[0] for fn, w in ROPE_VARIANTS]
        recs += [rk.rope_rows_launch(op, HD, NH, NKV, num_slots, w, ef).launch[0] for w, ef in ROWS_ROPE]
        plan = (rk.rope_rows_launch(op, HD, NH, NKV, num_slots).launch[0] if rows_plan
                else ew.qk_rope_launch(op, HD, NH, NKV, num_slots).launch[0])
    recs = [plan] + [r for r in recs if r != plan]
    return [(f"{r.fn} g{'x'.join(map(str, r.grid))} b{r.block[0]}" + (" (plan)" if r == plan else ""), r)
            for r in recs]


def source_of(fn: str) -> str:
    return "rows_prefill.cu" if "_rows" in fn else "rope_cache.cu" if fn.startswith("qk_") else "elementwise.cu"


def bench_prefill_elementwise(args, kernels_cls, time_graph, stream) -> None:
    """Each variant's output (and the residual / KV it writes) is compared bit for bit with the first launch's
    (the plan's kernel): `same` 1 = identical. Timing rotates over enough copies of the inputs to exceed L2 3x.
    args.variants: only the cases with a variant whose label holds one of these comma-separated substrings."""
    rows = [int(r) for r in args.rows.split(",")]
    torch.zeros(1, device="cuda")                      # torch's context current before the modules load
    kern = kernels_cls("elementwise.cu", "rope_cache.cu", "rows_prefill.cu")
    gen = torch.Generator(device="cuda").manual_seed(4321)
    print(f"prefill row kernels, Qwen3-8B shape (H {H}, I {INTER}, nh {NH}, nkv {NKV}, hd {HD}); "
          f"GB/s = (reads + writes) / t vs {COPY_GBS:.0f} copy; rows_prefill.cu from {rk.ROWS_FROM} rows when "
          f"prefill_row_kernels resolves to rows (auto = {rk.AUTO})")
    print(f"{'kernel':52} {'M':>5} {'us':>8} {'GB/s':>7} {'%copy':>6} {'err':>8} same")
    best = {}
    for M in rows:
        for name, op, bufs, nbytes, check, outs, reset in cases(M, gen):
            ncopy = max(1, -(-3 * L2_BYTES // nbytes))
            copies = [bufs] + [{k: v.clone() for k, v in bufs.items()} for _ in range(ncopy - 1)]
            first = None
            variants = launches_of(op, M + 64, rk.uses_rows("auto", "prefill", M))
            if args.variants:                          # the plan's launch, then the variants named (substrings)
                keep = [v for v in variants[1:] if any(w in v[0] for w in args.variants.split(","))]
                if not keep:
                    continue
                variants = variants[:1] + keep
            for label, rec in variants:
                fn = kern.fn(source_of(rec.fn), rec.fn, rec.smem)
                lns = [Launch(rec.fn, fn, rec.grid, rec.block, rec.smem,
                              packed(rec, b, b["kv"].data_ptr() if "kv" in b else 0), pdl=False) for b in copies]
                if reset:
                    reset(bufs)
                for o in outs:
                    bufs[o].fill_(float("nan"))
                lns[0](stream())
                torch.cuda.synchronize()
                e = check(bufs)
                written = [bufs[o] for o in outs] + ([bufs["res"]] if "res" in bufs else [])
                got = torch.cat([t.view(torch.int16).flatten() for t in written])
                first = got if first is None else first
                same = int(torch.equal(got, first))
                ms = time_graph(lambda j: lns[j](stream()), ncopy)
                gbs = nbytes / ms / 1e6
                key = (name, M)
                best[key] = min(best.get(key, (ms, label)), (ms, label))
                print(f"{label:52} {M:5} {ms * 1e3:8.1f} {gbs:7.0f} {100 * gbs / COPY_GBS:6.1f} {e:8.1e} {same:4}",
                      flush=True)
            del copies
        torch.cuda.empty_cache()
    print("\nfastest per kernel and rows (us, %copy):")
    for (name, M), (ms, label) in best.items():
        print(f"  {name:20} {M:5} {ms * 1e3:8.1f}  {label}")
