#!/usr/bin/env python
"""Host overhead of the serving stack with an instant runner (xserv_aot.bench.host_overhead): engine steps/s and host
ms per step at each batch, for the engine alone and for engine + HTTP server with that many streaming clients.

  PYTHONPATH=. python scripts/host_overhead.py [--batches 1,64,256 --max-tokens 64 --prompt-len 8 --json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xserv_aot.bench.host_overhead import engine_only, make_tiny_plan, served  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if not all(1 <= b <= 256 for b in batches) or not 2 <= a.max_tokens <= 100 or not 1 <= a.prompt_len <= 24:
        p.error("batches in 1..256, --max-tokens in 2..100, --prompt-len in 1..24 (the plan's max_seq_len is 128)")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        plan = make_tiny_plan(Path(d))
        for b in batches:
            rows.append({"batch": b, "engine": engine_only(plan, b, a.max_tokens, a.prompt_len),
                         "served": served(plan, b, a.max_tokens, a.prompt_len)})
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"host overhead, instant runner ({cpu_name()}, commit {commit()})")
    for col in ("batch", "engine ms/step", "engine steps/s", "served ms/step", "served p90 ms", "served steps/s",
                "stream TPOT ms", "steps measured"):
        t.add_column(col, justify="right")
    for r in rows:
        e, s = r["engine"], r["served"]
        t.add_row(str(r["batch"]), f"{e['host_ms_per_step']:.3f}", f"{e['steps_per_s']:.0f}",
                  f"{s['host_ms_per_step']:.3f}", f"{s['p90_ms']:.3f}", f"{s['steps_per_s']:.0f}",
                  f"{s['stream_tpot_ms']:.3f}", f"{e['steps']}/{s['steps']}")
    Console().print(t)
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                      "cpu": cpu_name(), "commit": commit(), "max_tokens": a.max_tokens,
                                      "prompt_len": a.prompt_len, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
