"""The `xserv-aot` command line: compile, inspect, generate, chat, serve, profile, bench, bench-serve."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from xserv_aot.errors import XservError, one_line

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ahead-of-time compiled LLM inference: compile a model into a static-shape plan, then serve it.")
OPTIONS = {"debug": False}                           # set once per process by the top-level options below


@app.callback()
def main_options(debug: bool = typer.Option(False, "--debug", help="tracebacks for every error")):
    OPTIONS["debug"] = debug


def fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(1)


def _ints(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"expected a comma-separated list of integers, got {text!r}")


def guarded(fn):
    """User-facing errors (XservError) become `error: ...` + exit 1; anything else is a bug and keeps its
    traceback; with --debug every error does."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except XservError as e:
            if OPTIONS["debug"]:
                raise
            fail(one_line(e) or type(e).__name__)
    return wrapper


@app.command()
@guarded
def compile(
    model: Path = typer.Argument(..., help="HF model dir (config.json + safetensors), a .gguf file, or a config.json with --dummy-weights"),
    out: Path = typer.Option(..., "-o", "--out", help="plan directory to write"),
    build_config: Optional[Path] = typer.Option(None, help="JSON with build defaults, e.g. plans/h200.build.json"),
    max_num_seqs: Optional[int] = typer.Option(None, help="largest decode batch"),
    decode_buckets: Optional[str] = typer.Option(None, help="decode batch sizes, e.g. 1,2,4,8"),
    prefill_buckets: Optional[str] = typer.Option(None, help="prefill token counts; the largest is the prefill chunk"),
    max_seq_len: Optional[int] = typer.Option(None),
    block_size: Optional[int] = typer.Option(None, help="KV block size in tokens"),
    num_blocks: Optional[int] = typer.Option(None, help="KV blocks in the pool (default: max_num_seqs full sequences)"),
    kv_memory_gib: Optional[float] = typer.Option(None, "--kv-memory", help="size the KV pool in GiB instead of --num-blocks"),
    dtype: Optional[str] = typer.Option(None, help="bfloat16 | float32"),
    target: Optional[str] = typer.Option(None, help="GPU arch for kernels (sm_90a) or cpu"),
    gemm_library: Optional[bool] = typer.Option(None, help="CUTLASS GEMMs for linears of >= 128 rows (default on)"),
    pdl: Optional[bool] = typer.Option(None, help="programmatic dependent launch of every kernel (default off)"),
    gemm_residual: Optional[bool] = typer.Option(None, help="o_proj / down add the residual in their CUTLASS "
                                                 "epilogue (default off)"),
    tensor_parallel: Optional[int] = typer.Option(None, help="ranks (GPUs) to shard the model over: 1, 2, 4 or 8"),
    quantization: Optional[str] = typer.Option(None, help="none | fp8: e4m3 linear weights with scales"),
    fp8_scheme: Optional[str] = typer.Option(None, help="fp8 scales: channel | block128 | auto (block128 where "
                                             "N and K divide by 128, else channel)"),
    quantize_lm_head: Optional[bool] = typer.Option(None, help="fp8: the lm_head too (default: it stays bf16)"),
    fp8_rounding: Optional[str] = typer.Option(None, help="fp8: nearest (default) | gptq: error-compensated "
                                               "rounding calibrated on built-in texts (same plan formats; compile "
                                               "time on a 2-core CPU: a minute for 135M, about 2 hours for 8B)"),
    fp8_scale: Optional[str] = typer.Option(None, help="fp8: amax (default: amax / 448 per row or block) | mse: "
                                            "the clipped scale of least squared rounding error | refit: least-squares "
                                            "scales on calibration text after rounding"),
    fp8_refit_rounds: Optional[int] = typer.Option(None, help="fp8 --fp8-scale refit: refits per weight, a "
                                                   "rounding between two (default 4 with nearest, 1 with gptq; "
                                                   "each more with gptq costs one more GPTQ pass)"),
    prefill_attention: Optional[str] = typer.Option(None, help="prefill attention kernel variant (auto: the "
                                                    "H200 default; see docs/cuda-notes.md)"),
    prefill_row_kernels: Optional[str] = typer.Option(None, help="v1 | rows | auto: the norm / silu_mul / rope "
                                                      "kernels of prefill buckets (plan/row_kernels.py)"),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="auto (= --dtype) | bfloat16 | fp8_e4m3: e4m3 KV "
                                                 "cache with per-layer scales (half the bytes)"),
    kv_cache_scales: Optional[str] = typer.Option(None, help="fp8_e4m3 KV scales: auto (the checkpoint's "
                                                  "k_scale / v_scale, else 1.0) | calibrate"),
    dummy_weights: bool = typer.Option(False, help="random weights from the config alone (benchmarks)"),
    seed: int = typer.Option(0, help="seed for --dummy-weights"),
    force: bool = typer.Option(False, help="replace an existing plan"),
    generation_config: str = typer.Option("auto", help="sampling defaults for the API: auto (the model's "
                                          "generation_config.json), vllm (none) or a path to one"),
):
    """Compile MODEL into a plan directory (no GPU needed)."""
    from xserv_aot.cli_compile import read_json_file, run_compile

    base = read_json_file(build_config, "build config") if build_config else {}
    given = dict(max_num_seqs=max_num_seqs, decode_buckets=_ints(decode_buckets), prefill_buckets=_ints(prefill_buckets),
                 max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks, dtype=dtype, target=target,
                 gemm_library=gemm_library, pdl=pdl, gemm_residual=gemm_residual, tensor_parallel=tensor_parallel,
                 quantization=quantization, fp8_scheme=fp8_scheme, quantize_lm_head=quantize_lm_head,
                 fp8_rounding=fp8_rounding, fp8_scale=fp8_scale, fp8_refit_rounds=fp8_refit_rounds,
                 prefill_attention=prefill_attention, prefill_row_kernels=prefill_row_kernels,
                 kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales)
    run_compile(model, out, base, given, kv_memory_gib, dummy_weights, seed, force, generation_config)


@app.command()
@guarded
def inspect(plan_dir: Path = typer.Argument(..., metavar="PLAN"),
            ops: Optional[str] = typer.Option(None, help="print the op list of this bucket (e.g. decode_1)"),
            roofline: bool = typer.Option(False, help="per bucket: bytes, FLOPs and the floor they imply on the target"),
            context: int = typer.Option(128, help="--roofline: context length of every sequence")):
    """Print a plan's memory map, buckets, op list and the bytes each decode step reads."""
    from xserv_aot.plan.inspect import describe

    if context < 1:
        fail(f"--context must be >= 1, got {context}")
    typer.echo(describe(plan_dir, ops, roofline=roofline, context=context))


def load_runner(plan_dir: Path, backend: str):
    from xserv_aot.plan.manifest import Plan
    from xserv_aot.runtime.select import make_runner

    plan = Plan.load(plan_dir)
    return make_runner(plan, backend)


def load_tokenizer(plan_dir: Path):
    from xserv_aot.tokenizer import Tokenizer

    if not (Path(plan_dir) / "tokenizer.json").is_file():
        fail(f"{plan_dir}: plan has no tokenizer (compiled from a model without tokenizer.json)")
    return Tokenizer.from_dir(plan_dir)


@app.command()
@guarded
def generate(
    plan_dir: Path = typer.Argument(..., metavar="PLAN"),
    prompt: str = typer.Argument(...),
    max_tokens: int = typer.Option(128),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(0),
    raw: bool = typer.Option(False, help="send the prompt as is, without the chat template"),
    think: bool = typer.Option(False, help="Qwen3: enable_thinking in the chat template"),
    backend: str = typer.Option("auto", help="cuda | cpu | auto"),
):
    """Generate from one prompt, streamed to the terminal; tok/s at the end."""
    from xserv_aot.generate import stream_generate

    runner = load_runner(plan_dir, backend)
    tok = load_tokenizer(plan_dir)
    ids = tok.encode(prompt) if raw else tok.encode_chat([{"role": "user", "content": prompt}], enable_thinking=think)
    stats = stream_generate(runner, tok, ids, max_tokens, dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
                            sys.stdout.write)
    typer.secho(f"\n[{stats['tokens']} tokens, prefill {stats['ttft_s'] * 1e3:.0f} ms, "
                f"decode {stats['tok_per_s']:.1f} tok/s, backend {type(runner).__name__}]", fg="cyan", err=True)


@app.command()
@guarded
def chat(plan_dir: Path = typer.Argument(..., metavar="PLAN"), max_tokens: int = typer.Option(512),
         temperature: float = typer.Option(0.7), system: Optional[str] = typer.Option(None),
         think: bool = typer.Option(False, help="Qwen3: enable_thinking"), backend: str = typer.Option("auto")):
    """Interactive multi-turn chat using the model's chat template (empty line or Ctrl-D quits)."""
    from xserv_aot.generate import stream_generate

    runner = load_runner(plan_dir, backend)
    tok = load_tokenizer(plan_dir)
    messages = [{"role": "system", "content": system}] if system else []
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        ids = tok.encode_chat(messages, enable_thinking=think)
        sys.stdout.write("assistant> ")
        parts: list[str] = []
        stream_generate(runner, tok, ids, max_tokens, dict(temperature=temperature, seed=turn),
                        lambda s: (parts.append(s), sys.stdout.write(s), sys.stdout.flush()))
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(parts)})
        turn += 1


@app.command()
@guarded
def serve(plan_dir: Path = typer.Argument(..., metavar="PLAN"),
          host: str = typer.Option("127.0.0.1", help="bind address (loopback by default)"),
          port: int = typer.Option(8000),
          api_key: Optional[str] = typer.Option(None, envvar="XSERV_API_KEY", help="bearer key for all but /health"),
          max_waiting: int = typer.Option(256, help="waiting-queue bound; beyond it requests get 429"),
          model_name: Optional[str] = typer.Option(None, help="name served in /v1/models (default: plan dir name)"),
          max_request_bytes: int = typer.Option(1_000_000, help="request body limit; larger bodies get 413"),
          backend: str = typer.Option("auto"),
          request_timeout: Optional[float] = typer.Option(None, help="seconds from arrival before a request is "
                                                          "aborted (504 / an error event); default: none"),
          shutdown_grace: float = typer.Option(30.0, help="on SIGTERM, seconds in-flight requests get to finish "
                                               "before they are aborted"),
          special_tokens_in_content: bool = typer.Option(False, help="let special-token text in chat messages "
                                                         "(e.g. <|im_end|>) become control tokens; default: text"),
          tool_call_parser: Optional[str] = typer.Option(None, help="hermes | llama3_json | none: how tool_choice "
                                                         "auto finds calls (default: from the chat template)"),
          metrics_require_key: bool = typer.Option(True, help="with --api-key, /metrics needs the key too; "
                                                   "--no-metrics-require-key opens it, as vLLM's is"),
          engine_process: bool = typer.Option(True, help="run the scheduler and runner in their own process "
                                              "(--no-engine-process: an engine thread in the server process)"),
          coalesce_stream_outputs: Optional[bool] = typer.Option(
              None, "--coalesce-stream-outputs/--no-coalesce-stream-outputs",
              help="a stream that fell behind the engine gets the tokens queued meanwhile as one chunk (engine "
                   "process only; default: on with it)")):
    """Serve PLAN with an OpenAI-compatible HTTP API."""
    from xserv_aot.serve import launch

    launch(plan_dir, host=host, port=port, api_key=api_key, max_waiting=max_waiting,
           model_name=model_name or Path(plan_dir).resolve().name, max_request_bytes=max_request_bytes, backend=backend,
           request_timeout=request_timeout, shutdown_grace=shutdown_grace,
           special_tokens_in_content=special_tokens_in_content, tool_call_parser=tool_call_parser,
           metrics_require_key=metrics_require_key, engine_process=engine_process,
           coalesce_outputs=coalesce_stream_outputs)


@app.command()
@guarded
def bench(plan_dir: Path = typer.Argument(..., metavar="PLAN"), backend: str = typer.Option("auto"),
          prompt_len: int = typer.Option(128), decode_steps: int = typer.Option(64),
          batch: int = typer.Option(1)):
    """Measure time to first token and decode tok/s on random prompts."""
    from xserv_aot.bench.offline import run_bench

    runner = load_runner(plan_dir, backend)
    typer.echo(json.dumps(run_bench(runner, prompt_len, decode_steps, batch), indent=1))


@app.command("bench-serve", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_serve(ctx: typer.Context):
    """Serving benchmark against any OpenAI-compatible server (vLLM `bench serve` flags; --help lists them)."""
    from xserv_aot.bench.serve import main as bench_serve_main

    raise typer.Exit(bench_serve_main(ctx.args))


@app.command()
@guarded
def verify(plan_dir: Path = typer.Argument(..., metavar="PLAN")):
    """Check every weights chunk, the weights layout and every kernel file of PLAN against its manifest."""
    import time

    from xserv_aot.plan.manifest import Plan

    t0 = time.perf_counter()
    plan = Plan.load(plan_dir, verify="full")
    w = plan.manifest["weights"]
    chunks = len((w.get("chunks") or {}).get("sha256", []))
    what = (f"{w['size'] / 2**30:.3f} GiB of weights in {chunks} chunks" if plan.weights_file is not None
            else f"dummy weights (seed {plan.dummy_seed}, made at load: no file)")
    typer.echo(f"ok: {plan_dir}: {what}, {len(plan.kernel_files())} kernel files match the manifest "
               f"({time.perf_counter() - t0:.2f} s)")


@app.command()
@guarded
def profile(plan_dir: Path = typer.Argument(..., metavar="PLAN"), bucket: str = typer.Option("decode_1"),
            context: int = typer.Option(128), trace: Optional[Path] = typer.Option(None, help="Chrome-trace JSON out"),
            nsys: bool = typer.Option(False, help="run this profile under Nsight Systems (--trace cuda,nvtx)"),
            ncu: bool = typer.Option(False, help="run one eager step under Nsight Compute; per-kernel DRAM/SM "
                                     "throughput and occupancy beside the plan's bytes and FLOPs and the "
                                     "event-timed GB/s of the same op"),
            kernel: Optional[str] = typer.Option(None, help="--ncu: only kernels whose name matches this regex"),
            all_metrics: bool = typer.Option(False, help="--ncu: DRAM %, SM % and occupancy too (more replay "
                                             "passes per kernel; DRAM bytes and time take one)"),
            layers: Optional[int] = typer.Option(None, help="--ncu: profile decoder layers 0..N-1 and the ops "
                                                 "outside the layers (embedding, head); 0: every layer; default 2"),
            out: Optional[Path] = typer.Option(None, help="--nsys / --ncu: report path (default xserv-BUCKET for "
                                               "--nsys; --ncu keeps no report without it)"),
            nvtx: bool = typer.Option(False, help="NVTX ranges around every op and graph replay"),
            one_step: bool = typer.Option(False, hidden=True, help="one eager step between cuProfilerStart/Stop"),
            events_out: Optional[Path] = typer.Option(None, hidden=True, help="--one-step: event times JSON out")):
    """Per-op timing of one bucket on the GPU (CUDA events) plus whole-graph step time; or --nsys / --ncu."""
    if nsys and ncu:
        fail("--nsys and --ncu are exclusive")
    if context < 1:
        fail(f"--context must be >= 1, got {context}")
    if layers is not None and layers < 0:
        fail(f"--layers must be >= 0, got {layers}")
    if nsys or ncu:
        from xserv_aot.runtime.nsight import run_ncu, run_nsys
        typer.echo(run_nsys(plan_dir, bucket, context, out) if nsys
                   else run_ncu(plan_dir, bucket, context, kernel, layers, out, all_metrics))
        return
    from xserv_aot.runtime.select import require_gpu

    require_gpu("profile")
    from xserv_aot.runtime.cuda.profile import profile_plan, run_one_step
    if one_step:
        typer.echo(run_one_step(plan_dir, bucket, context, nvtx=True, layers=layers or 0, events_out=events_out))
        return
    typer.echo(profile_plan(plan_dir, bucket=bucket, context=context, trace=trace, nvtx=nvtx))


def main():
    app()


if __name__ == "__main__":
    main()
