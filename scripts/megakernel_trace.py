#!/usr/bin/env python3
"""Where a decode megakernel step spends its time (device machine): a copy of PLAN whose decode_N launch writes
its globaltimer stamps into the arena's mk_trace buffer (kernels/decode_megakernel.cu, MK_TRACE a block and
layer), one eager step at the given context, then per phase the median over blocks and layers of: prologue
(barrier passed -> first slot consumed), consume, waits on the ring inside consume, finalize + grid barrier.

  python3 scripts/megakernel_trace.py PLAN [--bucket decode_1] [--context 128] [--json out.json] [--raw out.npy]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xserv_aot.plan.kernel_constants import MK_TRACE  # noqa: E402
from xserv_aot.plan.megakernel_plan import MK_PREFIX  # noqa: E402

# (name, start stamp, end stamp) over the 14 phase edges of a layer; the next layer's 0 closes the down phase
SPANS = [("qkv prologue", 0, 1), ("qkv consume", 1, 2), ("qkv finalize + barrier", 2, 3), ("attention", 3, 4),
         ("attention barrier", 4, 5), ("o prologue", 5, 6), ("o consume", 6, 7), ("o finalize + barrier", 7, 8),
         ("gate_up prologue", 8, 9), ("gate_up consume", 9, 10), ("gate_up finalize + barrier", 10, 11),
         ("down prologue", 11, 12), ("down consume", 12, 13)]
WAITS = ["qkv ring wait", "o ring wait", "gate_up ring wait", "down ring wait"]
# (name, consume-end stamp, arrival stamp, barrier-passed stamp; -1: the next layer's 0)
ARRIVALS = [("qkv", 2, 18, 3), ("o", 7, 19, 8), ("gate_up", 10, 20, 11), ("down", 13, 21, -1)]


def traced_copy(plan_dir: Path, bucket: str, out: Path) -> None:
    shutil.copytree(plan_dir, out, dirs_exist_ok=True)
    m = json.loads((out / "manifest.json").read_text())
    hit = 0
    for bk in m["buckets"]:
        for op in bk["ops"] if bk["name"] == bucket else ():
            for rec in (op.get("cuda") or {}).get("launch", []):
                if rec["fn"].startswith(MK_PREFIX):
                    i = next(i for i, a in enumerate(rec["args"]) if a == ["ptr", "mk_grid_barrier"]) + 1
                    rec["args"][i] = ["ptr", "mk_trace"]
                    hit += 1
    if not hit:
        sys.exit(f"{plan_dir}: bucket {bucket} runs no megakernel")
    (out / "manifest.json").write_text(json.dumps(m))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--bucket", default="decode_1")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--raw", help="save the stamps [blocks, layers, MK_TRACE] (ns) as .npy")
    args = ap.parse_args()
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.cuda.profile import decode_batch
    from xserv_aot.runtime.cuda.runner import CudaRunner
    with tempfile.TemporaryDirectory() as tmp:
        traced_copy(Path(args.plan), args.bucket, Path(tmp) / "plan")
        plan = Plan.load(Path(tmp) / "plan", verify="none")
        runner = CudaRunner(plan, capture=False)
        try:
            bk = next(b for b in plan.buckets if b.name == args.bucket)
            batch = decode_batch(plan, bk.num_seqs, args.context)
            for _ in range(3):
                runner.run_eager(bk.name, batch)
            sms = plan.build.megakernel_sms
            layers = plan.manifest["model"]["num_layers"]
            tr = runner.dev.dtoh(runner.buf("mk_trace"), (sms, layers, MK_TRACE), np.int64).astype(np.float64)
        finally:
            runner.close()
    if args.raw:
        np.save(args.raw, tr)
    t0 = tr[:, 0, 0].min()
    res = {"context": args.context, "bucket": args.bucket,
           "kernel_us": float((tr[:, -1, 13].max() - t0) / 1e3),
           "layer_us": float(np.median(np.diff(tr[0, :, 0])) / 1e3)}
    for name, a, b in SPANS:
        d = (tr[:, :, b] - tr[:, :, a]) / 1e3
        res[name] = {"median_us": float(np.median(d)), "max_us": float(d.max())}
    for k, name in enumerate(WAITS):
        d = tr[:, :, 14 + k] / 1e3
        res[name] = {"median_us": float(np.median(d)), "max_us": float(d.max())}
    for name, e, arr, ps in ARRIVALS:
        fin = (tr[:, :, arr] - tr[:, :, e]) / 1e3
        res[f"{name} finalize"] = {"median_us": float(np.median(fin)), "max_us": float(fin.max())}
        # the barrier's own latency: passed by the first block after the last block arrived
        at, passed = (tr[:, :-1, arr], tr[:, 1:, 0]) if ps < 0 else (tr[:, :, arr], tr[:, :, ps])
        lat = (passed.min(0) - at.max(0)) / 1e3
        res[f"{name} barrier after last arrival"] = {"median_us": float(np.median(lat)), "max_us": float(lat.max())}
    busy = tr[:, :, 4] > tr[:, :, 3] + 500          # blocks with an attention item (stamps 23-25 written)
    for name, a, b in (("attention: q, k, v prepared", 3, 23), ("attention: key tiles", 23, 24),
                       ("attention: merge + split written", 24, 25), ("attention: combine", 25, 4)):
        d = ((tr[:, :, b] - tr[:, :, a]) / 1e3)[busy]
        if d.size:
            res[name] = {"median_us": float(np.median(d)), "max_us": float(d.max())}
    pf = tr[:, :, 22]
    res["producer L2 prefetches a layer"] = {"median_us": float(np.median(pf)), "max_us": float(pf.max())}  # slots
    print(f"{args.bucket} at context {args.context}: kernel {res['kernel_us']:.0f} us, "
          f"a layer {res['layer_us']:.1f} us")
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"  {k:28s} median {v['median_us']:7.2f} us  max {v['max_us']:7.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
