"""Prometheus metrics for one server app, in its own CollectorRegistry (no global registry).

Request-level series are updated by the app; engine gauges (running, waiting, KV blocks, prefix cache,
preemptions) are read from engine.stats() at scrape time.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xserv_aot.engine.api import EngineStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                      0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineStatsCollector:
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:                                   # a scrape must not fail because the engine did
            log.exception("engine.stats() failed during a metrics scrape")
            return
        gauges = {
            "xserv_num_requests_running": ("Requests in the running batch.", s.num_running),
            "xserv_num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "xserv_kv_cache_usage_ratio": ("Fraction of KV cache blocks in use (0..1).",
                                           s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
            "xserv_kv_cache_blocks_used": ("KV cache blocks in use.", s.kv_blocks_used),
            "xserv_kv_cache_blocks_total": ("KV cache blocks in the pool.", s.kv_blocks_total),
            "xserv_prefix_cache_hit_rate": ("Prefix cache hits / queries over the engine's lifetime (0..1).",
                                            s.prefix_cache_hits / s.prefix_cache_queries
                                            if s.prefix_cache_queries else 0.0),
            "xserv_engine_healthy": ("1 while the engine is healthy.", 1.0 if s.healthy else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "xserv_prefix_cache_queries": ("Prompt blocks looked up in the prefix cache.", s.prefix_cache_queries),
            "xserv_prefix_cache_hits": ("Prompt blocks found in the prefix cache.", s.prefix_cache_hits),
            "xserv_num_preemptions": ("Requests preempted by the scheduler.", s.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("xserv_http_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("xserv_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("xserv_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("xserv_requests_finished", "Generation requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("xserv_requests_aborted", "Generation requests aborted (client gone or engine).",
                               registry=r)
        self.timeouts = Counter("xserv_request_timeouts", "Generation requests ended by --request-timeout.",
                                registry=r)
        self.ttft = Histogram("xserv_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("xserv_time_per_output_token_seconds",
                              "Mean time between output tokens of one request (after the first).",
                              buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("xserv_e2e_request_latency_seconds", "Arrival to the last output.",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineStatsCollector(engine_stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
