"""bench-serve output: a rich table on stdout and the --save-result JSON (written whole or not at all)."""
from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

LATENCIES = (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
             ("itl", "Inter-token latency"), ("e2el", "End-to-end latency"))
CONFIG_KEYS = ("base_url", "endpoint", "model", "dataset_name", "num_prompts", "random_input_len",
               "random_output_len", "random_range_ratio", "sharegpt_max_len", "request_rate", "burstiness",
               "max_concurrency", "seed", "temperature", "ignore_eos", "goodput_slos")


def print_report(a, m: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="Serving Benchmark Result", show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("Successful requests", f"{m['completed']}"), ("Failed requests", f"{m['failed']}"),
            ("Max concurrency", f"{a.max_concurrency or 'unlimited'}"),
            ("Request rate (req/s)", "inf" if math.isinf(a.request_rate) else f"{a.request_rate:g}"),
            ("Benchmark duration (s)", f"{m['duration']:.2f}"),
            ("Total input tokens", f"{m['total_input_tokens']}"),
            ("Total generated tokens", f"{m['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}")]
    if "request_goodput" in m:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in a.goodput_slos.items())
        rows.append((f"Request goodput (req/s), {slos}", f"{m['request_goodput']:.2f}"))
    for key, label in LATENCIES:
        rows.append((f"[bold]{label}[/bold]", ""))
        rows += [(f"  {s.capitalize()} {key.upper()} (ms)", f"{m[f'{s}_{key}_ms']:.2f}") for s in ("mean", "median", "p99")]
    rows.append(("Token counts from", m["token_counter"]))
    for name, value in rows:
        t.add_row(name, value)
    console.print(t)
    if m["failed"]:
        console.print(f"[red]{m['failed']} requests failed; first error: {m['errors'][0]}[/red]", soft_wrap=True)
    if m.get("ignore_eos_violations"):
        console.print(f"[red]warning: {m['ignore_eos_violations']} requests returned another output length than "
                      "asked for with ignore_eos: the server does not honor ignore_eos[/red]", soft_wrap=True)


def save_result(a, m: dict, path: Path) -> None:
    doc = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "tool": "xserv-aot bench-serve",
           **{k: _jsonable(getattr(a, k, None)) for k in CONFIG_KEYS}, **m}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _jsonable(v):
    return "inf" if isinstance(v, float) and math.isinf(v) else v
