#!/usr/bin/env python
"""Soak test: a bounded run of mixed OpenAI traffic with random disconnects against `xserv-aot serve` on loopback.

Starts the server as a child process on 127.0.0.1 (a tiny random Qwen3 plan with the real Qwen3 tokenizer unless
--plan is given), runs --clients concurrent clients for --duration seconds (chat + completions, streaming and not,
greedy / seeded / stop strings / logprobs / penalties; a --disconnect-rate share of requests is abandoned at a
random point), then checks:
  - zero errors for well-formed requests (HTTP 200, a valid finish_reason, usage within max_tokens, a stream that
    ends with [DONE] and no error event) and greedy probes that always give the same text;
  - every KV block returned, nothing running or waiting, the engine healthy (/metrics, after the load stops);
  - server RSS flat after warm-up: median of the first window after --warmup vs median of the last window.
Prints requests, tokens, errors and latency percentiles; --json writes them. Exit status 0 when all checks pass.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["river", "violet", "engine", "cloud", "harbor", "quartz", "meadow", "signal", "lantern", "orbit", "copper",
         "falcon", "garden", "pixel", "summit", "tundra", "velvet", "willow", "zephyr", "amber"]
PROBES = ["Describe the harbor at dawn.", "quartz meadow signal", "List three rivers.", "orbit lantern copper falcon"]
DISCONNECT_MODES = ("at_once", "half_body", "queued", "mid_stream", "reset")


def build_tiny_plan(out: Path, num_blocks: int) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import make_tiny_model
    from xserv_aot.config import BuildConfig
    from xserv_aot.plan.builder import compile_plan

    tok = ROOT / "build" / "assets" / "qwen3-tokenizer"
    if not (tok / "tokenizer.json").is_file():
        subprocess.run(["bash", str(ROOT / "scripts" / "fetch_assets.sh")], check=True)
    hf = make_tiny_model(out / "hf", "qwen3", seed=7, vocab_size=151936, num_hidden_layers=2, bos_token_id=151643,
                         eos_token_id=151645)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, hf / f)
    build = BuildConfig(max_num_seqs=4, decode_buckets=[1, 2, 4], prefill_buckets=[16, 64], max_seq_len=256,
                        block_size=4, dtype="float32", target="cpu", num_blocks=num_blocks)
    compile_plan(hf, out / "plan", build)
    return out / "plan"


class Server:
    """`python -m xserv_aot.cli serve PLAN --port 0` as a child; its log goes to a file."""

    def __init__(self, plan: Path, log_path: Path, start_timeout: float = 120.0):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "xserv_aot.cli", "serve", str(plan), "--host", "127.0.0.1", "--port", "0",
               "--backend", "cpu", "--model-name", "tiny", "--max-waiting", "1024"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline, self.url = time.monotonic() + start_timeout, None
        while self.url is None:
            m = re.search(rb"running on (http://127\.0\.0\.1:\d+)", log_path.read_bytes())
            if m:
                self.url = m.group(1).decode()
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; see {log_path}")
            else:
                time.sleep(0.1)

    def rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def log_errors(self, logger: str = "") -> list[str]:
        """ERROR lines of the server log; with logger, only those logged by it or its children."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if " ERROR " in ln or ln.startswith("ERROR")]
        return [ln for ln in errors if f" ERROR {logger}" in ln] if logger else errors

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.disconnects = self.tokens = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors: list[str] = []
        self.probe_text: dict[str, str] = {}
        self.by_kind: dict[str, int] = {}

    def record(self, kind: str, latency: float, tokens: int, ttft: float | None = None) -> None:
        with self.lock:
            self.ok += 1
            self.tokens += tokens
            self.latencies.append(latency)
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            if ttft is not None:
                self.ttfts.append(ttft)

    def error(self, msg: str) -> None:
        with self.lock:
            self.errors.append(msg)


def random_request(rng: random.Random) -> tuple[str, dict, str | None]:
    """(endpoint, body, probe key): a well-formed request of a random kind."""
    chat = rng.random() < 0.5
    if rng.random() < 0.1:
        probe = rng.choice(PROBES)
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
        key = f"{chat}:{probe}"
    else:
        probe = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 40)))
        body = {"max_tokens": rng.randrange(1, 64), "temperature": rng.choice([0, 0.7, 1.0])}
        if body["temperature"]:
            body.update(seed=rng.randrange(2 ** 31), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]))
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(["e", "the", "\n", "ing"])]
        if rng.random() < 0.15:
            body.update(presence_penalty=0.5, frequency_penalty=0.3)
        if rng.random() < 0.15:
            body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        key = None
    if chat:
        body["messages"] = [{"role": "user", "content": probe}]
    else:
        body["prompt"] = probe
    body["model"] = "tiny"
    body["stream"] = rng.random() < 0.5
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, key


def check_final(choice: dict, usage: dict, body: dict) -> str | None:
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        return f"finish_reason {reason!r}"
    n = usage.get("completion_tokens", 0)
    if not 1 <= n <= body["max_tokens"] or (reason == "length" and n != body["max_tokens"]):
        return f"completion_tokens {n} with max_tokens {body['max_tokens']} and finish_reason {reason}"
    return None


def well_formed(client, url: str, stats: Stats, rng: random.Random) -> None:
    path, body, probe = random_request(rng)
    chat, t0, ttft = "messages" in body, time.monotonic(), None
    kind = f"{'chat' if chat else 'completion'}{'-stream' if body['stream'] else ''}"
    try:
        if not body["stream"]:
            r = client.post(url + path, json=body)
            if r.status_code != 200:
                return stats.error(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")
            out = r.json()
            choice = out["choices"][0]
            msg = choice.get("message") or {}
            text = (msg.get("reasoning_content") or "") + (msg.get("content") or "") if chat else choice["text"]
            bad = check_final(choice, out["usage"], body)
            usage = out["usage"]
        else:
            chunks, text, finals, usage = [], [], [], None
            with client.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    return stats.error(f"{kind}: HTTP {r.status_code}")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        if ttft is None:
                            ttft = time.monotonic() - t0
            if not chunks or chunks[-1] != "[DONE]":
                return stats.error(f"{kind}: stream did not end with [DONE]")
            for c in map(json.loads, chunks[:-1]):
                if "error" in c:
                    return stats.error(f"{kind}: error event {c['error']}")
                usage = c.get("usage") or usage
                for ch in c["choices"]:
                    d = ch.get("delta") or {}
                    text.append((d.get("reasoning_content") or "") + (d.get("content") or "") if chat else ch["text"])
                    if ch.get("finish_reason"):
                        finals.append(ch)
            text = "".join(text)
            bad = (f"{len(finals)} finish chunks" if len(finals) != 1 else
                   "no usage chunk" if usage is None else check_final(finals[0], usage, body))
        if bad:
            return stats.error(f"{kind}: {bad}")
        if probe is not None:
            with stats.lock:
                first = stats.probe_text.setdefault(probe, text)
            if text != first:
                return stats.error(f"{kind}: greedy probe {probe!r} gave {text!r}, earlier {first!r}")
        stats.record(kind, time.monotonic() - t0, usage["completion_tokens"], ttft)
    except Exception as e:                           # a transport failure on a well-formed request is an error
        stats.error(f"{kind}: {type(e).__name__}: {e}")


def disconnect(url: str, stats: Stats, rng: random.Random) -> None:
    """Send a request and vanish at a random point (before the body ends, at once, while queued, mid-stream)."""
    mode = rng.choice(DISCONNECT_MODES)
    path, body, _ = random_request(rng)
    body["max_tokens"] = max(body["max_tokens"], 24)
    body["stream"] = mode in ("mid_stream", "reset") or (mode != "queued" and body["stream"])
    body.pop("stream_options", None)
    data = json.dumps(body).encode()
    host, port = url.rsplit("/", 1)[1].split(":")
    req = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(data)}\r\n\r\n").encode() + data
    try:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            if mode == "half_body":
                s.sendall(req[:-rng.randrange(1, 10)])
            else:
                s.sendall(req)
            if mode == "queued":
                time.sleep(rng.uniform(0, 0.5))
            elif mode in ("mid_stream", "reset"):
                want, buf = rng.randrange(1, 10), b""
                while buf.count(b"data: ") < want and b"[DONE]" not in buf:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                if mode == "reset":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError as e:
        return stats.error(f"disconnect client ({mode}): {type(e).__name__}: {e}")
    with stats.lock:
        stats.disconnects += 1


def client_loop(url: str, deadline: float, stats: Stats, seed: int, disconnect_rate: float) -> None:
    import httpx
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            if rng.random() < disconnect_rate:
                disconnect(url, stats, rng)
            else:
                well_formed(client, url, stats, rng)


def sample_rss(server: Server, t0: float, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        rss = server.rss_mib()
        if rss is not None:
            out.append((time.monotonic() - t0, rss))
        stop.wait(1.0)


def wait_drained(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = (m.get("xserv_num_requests_running", 1), m.get("xserv_num_requests_waiting", 1),
                m.get("xserv_kv_cache_blocks_used", 1))
        if busy == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def rss_windows(samples, duration: float, warmup: float, window: float) -> dict:
    first = [r for t, r in samples if warmup <= t < warmup + window] or [r for _, r in samples[:1]]
    last = [r for t, r in samples if t >= duration - window] or [r for _, r in samples[-1:]]
    all_rss = [r for _, r in samples]
    first_minute = [r for t, r in samples if t < window] or all_rss[:1]
    return {"rss_first_minute_mib": statistics.median(first_minute), "rss_first_window_mib": statistics.median(first),
            "rss_last_window_mib": statistics.median(last),
            "rss_max_mib": max(all_rss), "rss_growth_mib": statistics.median(last) - statistics.median(first),
            "rss_window_s": window, "rss_samples": len(samples)}


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="xserv-soak-"))
    plan = Path(args.plan) if args.plan else build_tiny_plan(work, args.num_blocks)
    server = Server(plan, work / "server.log")
    stats, rss, stop = Stats(), [], threading.Event()
    try:
        t0 = time.monotonic()
        deadline = t0 + args.duration
        sampler = threading.Thread(target=sample_rss, args=(server, t0, stop, rss), daemon=True)
        sampler.start()
        threads = [threading.Thread(target=client_loop, args=(server.url, deadline, stats, args.seed * 1000 + i,
                                                              args.disconnect_rate)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        stop.set()
        sampler.join()
        m = wait_drained(server.url)
        window = min(60.0, args.duration / 3)
        warmup = min(args.warmup, args.duration - 2 * window)
        result = {
            "plan": str(plan), "duration_s": round(elapsed, 1), "clients": args.clients,
            "disconnect_rate": args.disconnect_rate, "requests_ok": stats.ok, "disconnects": stats.disconnects,
            "errors": len(stats.errors), "error_samples": stats.errors[:10], "completion_tokens": stats.tokens,
            "requests_by_kind": stats.by_kind, "throughput_tok_s": round(stats.tokens / elapsed, 1),
            "latency_p50_s": percentile(stats.latencies, 0.5), "latency_p99_s": percentile(stats.latencies, 0.99),
            "ttft_p50_s": percentile(stats.ttfts, 0.5), "ttft_p99_s": percentile(stats.ttfts, 0.99),
            "probes_checked": len(stats.probe_text),
            "end_running": m.get("xserv_num_requests_running"), "end_waiting": m.get("xserv_num_requests_waiting"),
            "end_kv_blocks_used": m.get("xserv_kv_cache_blocks_used"),
            "kv_blocks_total": m.get("xserv_kv_cache_blocks_total"),
            "engine_healthy": m.get("xserv_engine_healthy"), "preemptions": m.get("xserv_num_preemptions_total"),
            "server_aborted": m.get("xserv_requests_aborted_total"),
            "rss_warmup_s": warmup, **rss_windows(rss, args.duration, warmup, window),
            "server_log_errors": len(server.log_errors()), "server_log_error_samples": server.log_errors()[:5],
            "engine_log_errors": len(server.log_errors("xserv_aot.engine")),
        }
    finally:
        stop.set()
        server.stop()
    checks = {
        "no errors on well-formed requests": result["errors"] == 0,
        "some requests served": result["requests_ok"] > 0,
        "nothing running or waiting at the end": result["end_running"] == 0 and result["end_waiting"] == 0,
        "every KV block returned": result["end_kv_blocks_used"] == 0,
        "engine healthy": result["engine_healthy"] == 1,
        "no engine errors in the server log": result["engine_log_errors"] == 0,
        f"RSS growth after warm-up <= {args.rss_tolerance_mib} MiB": result["rss_growth_mib"] <= args.rss_tolerance_mib,
    }
    result["checks"] = checks
    result["passed"] = all(checks.values())
    if result["passed"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        result["work_dir"] = str(work)
    return result


def report(r: dict) -> str:
    ms = lambda s: f"{s * 1000:.0f} ms"
    lines = [
        f"duration {r['duration_s']} s, {r['clients']} clients, disconnect rate {r['disconnect_rate']}",
        f"requests served (well-formed, checked) {r['requests_ok']}  by kind {r['requests_by_kind']}",
        f"deliberate disconnects {r['disconnects']}  (server counted {r['server_aborted']:.0f} aborted)",
        f"errors {r['errors']}  {r['error_samples'][:3] if r['errors'] else ''}",
        f"completion tokens {r['completion_tokens']}  ({r['throughput_tok_s']} tok/s)",
        f"latency p50 {ms(r['latency_p50_s'])}  p99 {ms(r['latency_p99_s'])};  "
        f"stream TTFT p50 {ms(r['ttft_p50_s'])}  p99 {ms(r['ttft_p99_s'])}",
        f"greedy probes checked {r['probes_checked']}, preemptions {r['preemptions']:.0f}",
        f"end: running {r['end_running']:.0f}, waiting {r['end_waiting']:.0f}, "
        f"KV blocks used {r['end_kv_blocks_used']:.0f}/{r['kv_blocks_total']:.0f}, healthy {r['engine_healthy']:.0f}",
        f"server RSS: first {r['rss_window_s']:.0f} s {r['rss_first_minute_mib']:.1f} MiB; first window "
        f"(after {r['rss_warmup_s']:.0f} s warm-up) {r['rss_first_window_mib']:.1f} MiB, "
        f"last window {r['rss_last_window_mib']:.1f} MiB (windows of {r['rss_window_s']:.0f} s), "
        f"growth {r['rss_growth_mib']:+.1f} MiB, max {r['rss_max_mib']:.1f} MiB",
        f"server log ERROR lines {r['server_log_errors']} (engine: {r['engine_log_errors']})"
        + "".join(f"\n    {ln[:160]}" for ln in r["server_log_error_samples"][:3]),
    ]
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in r["checks"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", help="plan to serve (default: build a tiny random Qwen3 plan)")
    ap.add_argument("--num-blocks", type=int, default=64, help="KV blocks of the built plan (block size 4)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--disconnect-rate", type=float, default=0.15)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the first RSS window")
    ap.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (plan, server log)")
    args = ap.parse_args(argv)
    if args.duration < 3 or args.clients < 1:
        ap.error("--duration must be >= 3 and --clients >= 1")
    r = run(args)
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print("PASS" if r["passed"] else "FAIL")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
