#!/usr/bin/env python
"""Where a served step's time goes: `xserv-aot serve` (engine core process, the default overlap) with a step timer
in the core (xserv_aot.bench.step_timer), loaded by the serving benchmark's client (c256 by default), and the CPU
time of the API process (per thread), the engine core and the client over the run.

  python3 scripts/serve_steps.py PLAN --out DIR [--prefill-chunk 2048] [--no-overlap] [--no-coalesce]
  python3 scripts/serve_steps.py --emulate TOKENIZER_DIR --out DIR      (CPU: tiny plan, EmulatedDevice 12 ms steps)

--prefill-chunk N: the scheduler's largest prompt chunk (a step without decodes) is N instead of the plan's largest
prefill bucket (the buckets themselves are the plan's). Writes DIR/steps.json (summary, environment), DIR/steps.npy (one row per step: COLUMNS) and the
client's DIR/client.json, DIR/client.txt.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xserv_aot.bench.host_overhead import wait_healthy  # noqa: E402
from xserv_aot.bench.instant_runner import StepLog  # noqa: E402
from xserv_aot.bench.step_timer import COLUMNS, StepTimer, summarize, timed_emulated  # noqa: E402

PACKAGES = ("numpy", "uvicorn", "h11", "starlette", "httpx", "httpcore", "anyio", "msgspec", "pyzmq", "tokenizers")


def _serve(plan_dir: str, backend: str, port: int, wrapper, engine_kwargs: dict, coalesce: bool) -> None:
    from xserv_aot.serve import build_engine
    from xserv_aot.server.run import run_server
    engine = build_engine(plan_dir, backend=backend, max_waiting=4096, engine_process=True,
                          runner_wrapper=wrapper, engine_kwargs=engine_kwargs,
                          coalesce_outputs=coalesce)
    run_server(engine, port=port, log_level="warning", max_in_flight=4096, shutdown_grace=1.0)


def cpu_seconds(pid: int) -> dict[str, float]:
    """utime + stime of each thread of pid ("pid/tid" -> s), and of its child processes' threads."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    pids = [pid] + [int(c) for c in _read(f"/proc/{pid}/task/{pid}/children").split()]
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            fields = _read(f"/proc/{p}/task/{t}/stat").rsplit(")", 1)[-1].split()
            if len(fields) > 12:
                out[f"{p}/{t}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    return {"python": sys.version.split()[0], "packages": versions, "cpu": cpu, "cpus": os.cpu_count(),
            "loadavg": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", nargs="?", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--emulate", type=Path, metavar="TOKENIZER_DIR", help="CPU: tiny plan, emulated device")
    p.add_argument("--decode-ms", type=float, default=12.0, help="--emulate: device time of a decode step")
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--no-coalesce", action="store_true", help="EngineCoreClient coalesce_outputs off (on: a stream "
                   "that fell behind gets its queued outputs as one chunk)")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=256)
    a = p.parse_args()
    if (a.plan is None) == (a.emulate is None):
        p.error("give a PLAN or --emulate TOKENIZER_DIR")
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory()
    from xserv_aot.plan.manifest import Plan
    if a.emulate:
        from xserv_aot.bench.host_overhead import make_tiny_plan
        plan_dir, backend = make_tiny_plan(Path(tmp.name), max_seq_len=512, tokenizer_dir=a.emulate,
                                           vocab_size=151936), "cpu"
    else:
        plan_dir, backend = a.plan, "cuda"
    build = Plan.load(plan_dir, verify="none").build
    log_path = Path(tmp.name) / "steps"
    StepLog.create(log_path, width=len(COLUMNS))
    wrapper = (functools.partial(timed_emulated, step_log=str(log_path), decode_ms=a.decode_ms) if a.emulate
               else functools.partial(StepTimer, step_log=str(log_path)))
    engine_kwargs = {"overlap": False} if a.no_overlap else {}
    if a.prefill_chunk:
        buckets = [b for b in build.prefill_buckets if b <= a.prefill_chunk]
        engine_kwargs["build"] = dataclasses.replace(build, prefill_buckets=buckets)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(str(plan_dir), backend, port, wrapper, engine_kwargs, not a.no_coalesce), daemon=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, server, 600, poll=0.5):
            print("the server did not start", file=sys.stderr)
            return 1
        cmd = [sys.executable, "-m", "xserv_aot.bench.serve", "--base-url", url, "--tokenizer", str(plan_dir),
               "--seed", "0", "--dataset-name", "random", "--disable-tqdm", "--save-result", str(a.out / "client.json"),
               "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
               "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.clients)]
        cpu0, kids0, t0 = cpu_seconds(server.pid), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        with open(a.out / "client.txt", "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)),
                                timeout=900).returncode
        wall = time.perf_counter() - t0
        cpu1, kids1 = cpu_seconds(server.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        server.terminate()
        server.join(60)
    rows = StepLog(log_path, mode="r").rows()
    import numpy as np
    np.save(a.out / "steps.npy", rows)
    busy = {k: (cpu1[k] - cpu0.get(k, 0.0)) / wall for k in cpu1}
    report = {"plan": str(plan_dir), "emulated_decode_ms": a.decode_ms if a.emulate else None,
              "overlap": not a.no_overlap, "coalesce": not a.no_coalesce, "prefill_chunk": a.prefill_chunk or build.prefill_chunk,
              "client_rc": rc, "client_wall_s": wall,
              "cpu_busy": {"client": (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime) / wall,
                           "threads": dict(sorted(busy.items(), key=lambda kv: -kv[1])[:8]),
                           "api_process": sum(v for k, v in busy.items() if k.startswith(f"{server.pid}/")),
                           "engine_core": sum(v for k, v in busy.items() if not k.startswith(f"{server.pid}/"))},
              "steps": summarize(rows, build.max_num_seqs), "environment": environment()}
    (a.out / "steps.json").write_text(json.dumps(report, indent=1))
    print(_read(str(a.out / "client.txt")))
    print(json.dumps({k: report[k] for k in ("overlap", "coalesce", "prefill_chunk", "cpu_busy")}, indent=1))
    print(json.dumps({k: v for k, v in report["steps"].items() if k != "longest_intervals"}, indent=1))
    print("longest intervals:", json.dumps(report["steps"]["longest_intervals"][:5]))
    print("environment:", json.dumps(report["environment"]))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
