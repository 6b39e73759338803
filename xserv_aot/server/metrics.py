"""Prometheus metrics for one server app, in its own CollectorRegistry (no global registry).

Request-level series are updated by the app; engine gauges (running, waiting, KV blocks, prefix cache,
preemptions) are read from engine.stats() at scrape time. Every series a vLLM dashboard reads is also exported
under vLLM's name with a model_name label (VLLM_* below), fed by the same updates.
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


VLLM_FINISH_REASONS = ("stop", "length", "abort")          # vllm:request_success_total's finished_reason values


class _Tee:
    """Forwards inc/observe to an xserv series and its vLLM twin."""

    def __init__(self, *series):
        self._series = series

    def inc(self, amount: float = 1.0) -> None:
        for s in self._series:
            s.inc(amount)

    def observe(self, value: float) -> None:
        for s in self._series:
            s.observe(value)


class _FinishedCounter:
    """xserv_requests_finished{finish_reason} plus vllm:request_success_total{model_name, finished_reason}."""

    def __init__(self, own: Counter, vllm: Counter, model_name: str):
        self._own, self._vllm, self._model = own, vllm, model_name

    def labels(self, reason: str) -> _Tee:
        twins = (self._vllm.labels(self._model, reason),) if reason in VLLM_FINISH_REASONS else ()
        return _Tee(self._own.labels(reason), *twins)


class _EngineStatsCollector:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self._stats, self._model = stats, model_name

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
        vllm = {"vllm:num_requests_running": ("Requests in the running batch.", s.num_running),
                "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
                "vllm:kv_cache_usage_perc": ("KV cache usage (1 = full).", gauges["xserv_kv_cache_usage_ratio"][1])}
        for name, (doc, value) in vllm.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str = ""):
        r = self.registry = CollectorRegistry()
        m = [model_name]

        def vllm_counter(name: str, doc: str):
            return Counter(name, doc, ["model_name"], registry=r).labels(*m)

        def vllm_histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(*m)
        self.requests = Counter("xserv_http_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = _Tee(Counter("xserv_prompt_tokens", "Prompt tokens of finished requests.", registry=r),
                                  vllm_counter("vllm:prompt_tokens", "Prompt tokens of finished requests."))
        self.generation_tokens = _Tee(Counter("xserv_generation_tokens", "Generated tokens.", registry=r),
                                      vllm_counter("vllm:generation_tokens", "Generated tokens."))
        self.finished = _FinishedCounter(
            Counter("xserv_requests_finished", "Generation requests by finish reason.", ["finish_reason"], registry=r),
            Counter("vllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
                    registry=r), model_name)
        self.aborted = Counter("xserv_requests_aborted", "Generation requests aborted (client gone or engine).",
                               registry=r)
        self.timeouts = Counter("xserv_request_timeouts", "Generation requests ended by --request-timeout.",
                                registry=r)
        self.ttft = _Tee(Histogram("xserv_time_to_first_token_seconds", "Arrival to first generated token.",
                                   buckets=LATENCY_BUCKETS, registry=r),
                         vllm_histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.",
                                        LATENCY_BUCKETS))
        self.tpot = Histogram("xserv_time_per_output_token_seconds",
                              "Mean time between output tokens of one request (after the first).",
                              buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.itl = vllm_histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                                  TOKEN_TIME_BUCKETS)
        self.e2e = _Tee(Histogram("xserv_e2e_request_latency_seconds", "Arrival to the last output.",
                                  buckets=LATENCY_BUCKETS, registry=r),
                        vllm_histogram("vllm:e2e_request_latency_seconds", "Arrival to the last output.",
                                       LATENCY_BUCKETS))
        r.register(_EngineStatsCollector(engine_stats, model_name))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
