"""`xserv-aot serve`: plan -> runner -> engine -> OpenAI-compatible HTTP server."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from xserv_aot.engine.api import EngineFailedError
from xserv_aot.engine.async_engine import AsyncEngine
from xserv_aot.engine.llm_engine import LLMEngine
from xserv_aot.errors import UsageError
from xserv_aot.server.gate import check_api_key
from xserv_aot.plan.manifest import Plan, PlanError
from xserv_aot.runtime.select import make_runner
from xserv_aot.tokenizer import Tokenizer

log = logging.getLogger("xserv_aot.serve")


def build_engine(plan_dir: Path, *, backend: str = "auto", max_waiting: int = 256, model_name: str | None = None,
                 verify: str = "full", engine_process: bool = False, runner_factory: Callable | None = None,
                 **core_kwargs):
    """An AsyncEngine (engine thread in this process), or with engine_process an EngineCoreClient (scheduler,
    runner and device in a child process; core_kwargs go to it, e.g. runner_wrapper for fault injection).
    runner_factory(plan) -> runner replaces the backend's runner of the in-process engine (the injection point for
    test doubles such as bench.instant_runner.InstantRunner; keep it picklable: a top-level class or a
    functools.partial of one)."""
    model_name = model_name or Path(plan_dir).resolve().name
    if engine_process:
        if runner_factory is not None:
            raise ValueError("runner_factory replaces the runner of the in-process engine; the engine process takes "
                             "runner_wrapper")
        from xserv_aot.engine.core_client import EngineCoreClient
        return EngineCoreClient(plan_dir, backend=backend, model_name=model_name, max_waiting=max_waiting,
                                verify=verify, **core_kwargs)
    plan = Plan.load(plan_dir, verify=verify)
    if not plan.has_tokenizer:
        raise PlanError(f"{plan_dir}: plan has no tokenizer; serving needs one")
    tokenizer = Tokenizer.from_dir(plan.dir)
    runner = runner_factory(plan) if runner_factory is not None else make_runner(plan, backend)
    log.info("plan %s: %s on %s, %d buckets, max_seq_len %d", plan.dir, plan.model.arch, type(runner).__name__,
             len(plan.buckets), plan.build.max_seq_len)
    engine = LLMEngine(runner, tokenizer)
    return AsyncEngine(engine, model_name=model_name, max_waiting=max_waiting,
                       generation_defaults=plan.generation_defaults)


def launch(plan_dir: Path, *, host: str, port: int, api_key: str | None, max_waiting: int, model_name: str,
           max_request_bytes: int, backend: str, request_timeout: float | None = None,
           shutdown_grace: float = 30.0, special_tokens_in_content: bool = False, tool_call_parser: str | None = None,
           metrics_require_key: bool = True, engine_process: bool = True, coalesce_outputs: bool | None = None) -> None:
    """Blocks until SIGTERM/SIGINT: then drains (shutdown_grace seconds for requests in flight) and returns.
    Raises EngineFailedError when the engine core process died (the server stopped; the CLI exits 1).
    coalesce_outputs None: the engine process's default (EngineCoreClient: on)."""
    from xserv_aot.server.run import bind_socket, run_server

    if request_timeout is not None and not request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    if not shutdown_grace >= 0:
        raise UsageError(f"--shutdown-grace must be >= 0 seconds, got {shutdown_grace}")
    if max_waiting < 1:
        raise UsageError(f"--max-waiting must be >= 1, got {max_waiting}")
    if coalesce_outputs and not engine_process:
        raise UsageError("--coalesce-stream-outputs needs the engine process (not --no-engine-process)")
    check_api_key(api_key)
    from xserv_aot.server.tools import PARSERS
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise UsageError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    if max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    sock = bind_socket(host, port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        core = {"coalesce_outputs": coalesce_outputs} if engine_process and coalesce_outputs is not None else {}
        engine = build_engine(plan_dir, backend=backend, max_waiting=max_waiting, model_name=model_name,
                              engine_process=engine_process, **core)
        engine.start()                             # startup errors end here, as one line
        try:
            run_server(engine, host=host, port=port, api_key=api_key, model_name=model_name,
                       max_request_bytes=max_request_bytes, request_timeout=request_timeout,
                       shutdown_grace=shutdown_grace, sock=sock, special_tokens_in_content=special_tokens_in_content,
                       tool_call_parser=tool_call_parser, metrics_require_key=metrics_require_key)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    if getattr(engine, "dead", None):
        raise EngineFailedError(f"{engine.dead}; the server stopped")
