"""Benchmarks: offline runner steps (offline), a serving benchmark against any OpenAI-compatible server (serve),
and the engine's host overhead with an instant runner (host_overhead)."""
