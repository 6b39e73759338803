#!/usr/bin/env python3
"""Timing-only copy of a plan without the ops of some kinds in some decode buckets (METHOD.md: time a variant that
leaves a stage out; the difference is what that stage costs where it sits, overlaps included). The copy's outputs are
wrong by design: use it with compare_plans.py --steps / profile, never to serve. Weights and kernels are hard links.

  python3 scripts/drop_ops.py PLAN OUT add_rmsnorm,rmsnorm [--buckets decode_1,decode_2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path


def drop_ops(src: Path, dst: Path, kinds: set[str], buckets: set[str] | None = None) -> dict[str, tuple[int, int]]:
    """Write dst (replaced) and return {bucket: (ops before, ops after)} for the decode buckets changed."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    for root, _, files in os.walk(src):
        (dst / Path(root).relative_to(src)).mkdir(parents=True, exist_ok=True)
        for f in files:
            if f != "manifest.json":
                os.link(Path(root) / f, dst / Path(root).relative_to(src) / f)
    manifest = json.loads((src / "manifest.json").read_text())
    changed = {}
    for bk in manifest["buckets"]:
        if bk["kind"] == "decode" and (buckets is None or bk["name"] in buckets):
            n = len(bk["ops"])
            bk["ops"] = [op for op in bk["ops"] if op["op"] not in kinds]
            changed[bk["name"]] = (n, len(bk["ops"]))
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("out")
    ap.add_argument("kinds", help="op kinds, comma separated (manifest op names, e.g. add_rmsnorm,attention)")
    ap.add_argument("--buckets", help="decode bucket names (default: every decode bucket)")
    args = ap.parse_args()
    changed = drop_ops(Path(args.plan), Path(args.out), set(args.kinds.split(",")),
                       set(args.buckets.split(",")) if args.buckets else None)
    for name, (n0, n1) in changed.items():
        print(f"{name}: {n0} -> {n1} ops")


if __name__ == "__main__":
    main()
