"""Serving metrics from timed requests (the definitions of vLLM's `bench serve`).

TTFT: send -> first chunk with text. E2EL: send -> end of stream. TPOT per request: (E2EL - TTFT) / (output - 1),
for requests with more than one output token. ITL: every gap between successive text chunks, over all requests.
Throughputs divide by the benchmark's wall time. Goodput: requests per second that meet every given SLO
(`ttft:MS`, `tpot:MS`, `e2el:MS`; a one-token request's TPOT counts as 0). Percentiles interpolate linearly.
"""
from __future__ import annotations

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
STATS = ("mean", "median", "std", "p99")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {val!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[key] = ms
    return slos


def output_tokens(r, counter=None) -> int:
    """The server's completion_tokens, else the client's count of the streamed text."""
    if r.completion_tokens is not None:
        return int(r.completion_tokens)
    if counter is not None:
        return counter.count([r.text], add_special_tokens=False)[0]
    return len(r.itl) + 1 if r.success else 0


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=np.float64) * 1e3 if seconds else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: list, duration: float, counter=None, goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    outs = [output_tokens(r, counter) for r in ok]
    ins = [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    all_tpots = [(r.latency - r.ttft) / (n - 1) if n > 1 else 0.0 for r, n in zip(ok, outs)]
    tpots = [t for t, n in zip(all_tpots, outs) if n > 1]
    itls = [g for r in ok for g in r.itl]
    m = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": int(sum(ins)), "total_output_tokens": int(sum(outs)),
         "request_throughput": len(ok) / duration, "output_throughput": sum(outs) / duration,
         "total_token_throughput": (sum(ins) + sum(outs)) / duration}
    if goodput:
        slo_s = {k: v / 1e3 for k, v in goodput.items()}
        good = sum(1 for t, tp, e in zip(ttfts, all_tpots, e2els)
                   if t <= slo_s.get("ttft", np.inf) and tp <= slo_s.get("tpot", np.inf)
                   and e <= slo_s.get("e2el", np.inf))
        m["request_goodput"] = good / duration
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values))
    m["input_lens"], m["output_lens"] = ins, outs
    m["ttfts"], m["itls"] = ttfts, [r.itl for r in ok]
    m["errors"] = [r.error for r in results if not r.success]
    return m
