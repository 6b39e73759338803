"""`scripts/bench_kernels.py prefill-elementwise [--rows 2048,4096,8192]`: the row-wise kernels of a prefill
chunk at the Qwen3-8B shape (add_rmsnorm, rmsnorm, silu_mul, qk_norm_rope_cache), launched with the plan's
geometry (plan.kernel_build's launch builders), outputs poisoned and checked against torch float32 (the rope
kernel: every q row and KV slot written, finite), timed in a CUDA graph. GB/s counts each kernel's reads + writes
once, against the 4.28 TB/s copy ceiling (read + write) of docs/cuda-notes.md."""
from __future__ import annotations

import torch

from xserv_aot.plan import kernel_build as kb
from xserv_aot.plan.op_records import AddRmsNorm, QkNormRopeCache, RmsNorm, SiluMul
from xserv_aot.runtime.cuda.driver import Launch

COPY_GBS = 4280.0
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


def launches_of(op, num_slots: int):
    """[(label, launch record)]: the plan's launch and the variants (the plan's geometry is marked)."""
    if isinstance(op, (AddRmsNorm, RmsNorm)):
        plan = kb.norm_launch(op, H).launch[0]
        recs = [kb.norm_launch(op, H, few_from=f).launch[0] for f in NORM_VARIANTS]
        return [(f"{op.op} t{r.block[0]}" + (" (plan)" if r == plan else ""), r) for r in recs]
    if isinstance(op, SiluMul):
        plan = kb.silu_mul_launch(op).launch[0]
        recs = [kb.silu_mul_launch(op, cap).launch[0] for cap in SILU_VARIANTS]
        return [(f"silu_mul g{r.grid[0]}" + (" (plan)" if r == plan else ""), r) for r in recs]
    return [(f"{fn} w{w}" + (" (plan)" if (fn, w) == (kb.ROPE_KERNEL, kb.ROPE_WARPS) else ""),
             kb.qk_rope_launch(op, HD, NH, NKV, num_slots, fn, w).launch[0]) for fn, w in ROPE_VARIANTS]


def bench_prefill_elementwise(args, kernels_cls, time_graph, stream) -> None:
    rows = [int(r) for r in args.rows.split(",")]
    torch.zeros(1, device="cuda")                      # torch's context current before the modules load
    kern = kernels_cls("elementwise.cu", "rope_cache.cu")
    gen = torch.Generator(device="cuda").manual_seed(4321)
    print(f"prefill row kernels, Qwen3-8B shape (H {H}, I {INTER}, nh {NH}, nkv {NKV}, hd {HD}); "
          f"GB/s = (reads + writes) / t vs {COPY_GBS:.0f} copy")
    print(f"{'kernel':36} {'M':>5} {'grid':>10} {'block':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} {'err':>8}")
    for M in rows:
        for name, op, bufs, nbytes, check, outs, reset in cases(M, gen):
            ref_out = None
            for label, rec in launches_of(op, M + 64):
                src = "rope_cache.cu" if name.startswith("qk_") else "elementwise.cu"
                ln = Launch(rec.fn, kern.fn(src, rec.fn, rec.smem), rec.grid, rec.block, rec.smem,
                            packed(rec, bufs, bufs["kv"].data_ptr() if "kv" in bufs else 0), pdl=False)
                if reset:
                    reset(bufs)
                for o in outs:
                    bufs[o].fill_(float("nan"))
                ln(stream())
                torch.cuda.synchronize()
                e = check(bufs)
                if name.startswith("qk_"):             # rope variants: compared with the first (scalar) kernel
                    got = torch.cat([bufs["q_out"].float().flatten(), bufs["kv"][:, :M].float().flatten()])
                    ref_out = got if ref_out is None else ref_out
                    e = max(e, err(got, ref_out) if got is not ref_out else 0.0)
                ms = time_graph(lambda j: ln(stream()), 1)
                gbs = nbytes / ms / 1e6
                grid = "x".join(str(g) for g in rec.grid if g > 1) or "1"
                print(f"{label:36} {M:5} {grid:>10} {rec.block[0]:6} {ms * 1e3:8.1f} {gbs:7.0f} "
                      f"{100 * gbs / COPY_GBS:6.1f} {e:8.1e}", flush=True)
        torch.cuda.empty_cache()
