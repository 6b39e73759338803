"""bench-serve: against the CPU server on loopback (exact token counts under ignore_eos), metric math on
hand-made timestamps, seeded datasets, one-line errors for bad flags."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fake_engine import LiveServer, tiny_plan
from xserv_aot.bench import datasets
from xserv_aot.bench.client import RequestResult
from xserv_aot.bench.metrics import compute_metrics, parse_goodput
from xserv_aot.bench.serve import arrival_gaps, main
from xserv_aot.bench.tokens import LocalCounter
from xserv_aot.serve import build_engine
from xserv_aot.server import create_app
from xserv_aot.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    return tiny_plan(tmp_path_factory)


@pytest.fixture(scope="module")
def server(plan_dir):
    engine = build_engine(plan_dir, backend="cpu", model_name="tiny")
    with LiveServer(create_app(engine, model_name="tiny", manage_engine=True)) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_exact_token_counts_against_cpu_server(server, plan_dir, tmp_path, capsys, endpoint):
    seed, n = 11, 6
    out = tmp_path / "r.json"
    rc = main(["--base-url", server, "--endpoint", endpoint, "--tokenizer", str(plan_dir), "--num-prompts", str(n),
               "--random-input-len", "20", "--random-output-len", "6", "--random-range-ratio", "0.5",
               "--max-concurrency", "3", "--seed", str(seed), "--goodput", "ttft:100000", "tpot:100000",
               "--save-result", str(out), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr().err
    r = json.loads(out.read_text())
    rng = np.random.default_rng(seed)                      # the documented draw: uniform in [L(1-r), L(1+r)]
    want_in, want_out = rng.integers(10, 31, n).tolist(), rng.integers(3, 10, n).tolist()
    assert r["completed"] == n and r["failed"] == 0 and r["ignore_eos_violations"] == 0
    assert sorted(r["output_lens"]) == sorted(want_out)    # the server's usage counts, in completion order
    assert r["total_output_tokens"] == sum(want_out)
    if endpoint == "/v1/completions":                      # the server's own prompt count == the designed length
        assert sorted(r["input_lens"]) == sorted(want_in)
    else:
        tok = Tokenizer.from_dir(plan_dir)
        template = len(tok.encode_chat([{"role": "user", "content": ""}])) - 1
        assert all(i > 0 for i in r["input_lens"]) and sum(r["input_lens"]) >= sum(want_in) + n * template
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert len(r["itls"]) == n and all(len(g) <= o - 1 for g, o in zip(r["itls"], r["output_lens"]))
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Output token throughput" in table


def test_metric_math_on_synthetic_timestamps():
    a = RequestResult(prompt_len=10, output_len=5, success=True, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1],
                      completion_tokens=5, prompt_tokens=12)
    b = RequestResult(prompt_len=20, output_len=3, success=True, ttft=0.3, latency=0.7, itl=[0.2, 0.2],
                      completion_tokens=3)
    c = RequestResult(prompt_len=7, output_len=1, success=True, ttft=0.05, latency=0.05, completion_tokens=1)
    d = RequestResult(prompt_len=9, output_len=4, success=False, error="HTTP 500: boom")
    m = compute_metrics([a, b, c, d], duration=2.0, goodput={"ttft": 200.0, "tpot": 150.0})
    assert (m["completed"], m["failed"], m["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert m["total_input_tokens"] == 12 + 20 + 7 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5) and m["total_token_throughput"] == pytest.approx(24.0)
    # TPOT: a (0.5-0.1)/4 = 100 ms, b (0.7-0.3)/2 = 200 ms; c has one token (no TPOT)
    assert m["mean_tpot_ms"] == pytest.approx(150.0) and m["median_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_tpot_ms"] == pytest.approx(100.0 + 0.99 * 100.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(100.0 + 0.98 * 200.0)       # sorted 50, 100, 300: rank 1.98
    # ITL: four gaps of 100 ms, two of 200 ms
    assert m["mean_itl_ms"] == pytest.approx(800.0 / 6) and m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(200.0)
    assert m["mean_e2el_ms"] == pytest.approx(1250.0 / 3)
    # goodput: a meets both SLOs, b misses TTFT (300 > 200) and TPOT, c meets both (TPOT counts 0): 2 / 2 s
    assert m["request_goodput"] == pytest.approx(1.0)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in ("ttft", "itl:5", "tpot:x", "ttft:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_prompts_have_exact_token_lengths(plan_dir):
    seed = 3
    tok = Tokenizer.from_dir(plan_dir)
    lengths = datasets.parse_dataset_lengths("sharegpt-synthetic", 40, seed, sharegpt_max_len=256)
    ins, outs = zip(*lengths)
    assert min(ins) >= 4 and max(ins) <= 128 and all(4 <= o <= 256 - i for i, o in lengths), seed
    assert len(set(ins)) > 10, seed                                      # a spread, not one length
    reqs = datasets.PromptBuilder(LocalCounter(plan_dir), seed).build(lengths)
    assert [len(tok.encode(r.prompt)) for r in reqs] == list(ins), seed
    again = datasets.PromptBuilder(LocalCounter(plan_dir), seed).build(lengths)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert len({r.prompt for r in reqs}) == len(reqs)


def test_poisson_gaps_have_the_requested_rate():
    seed = 5
    gaps = arrival_gaps(20000, 8.0, 1.0, seed)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03), seed
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05), seed          # exponential: std == mean
    assert not arrival_gaps(5, float("inf"), 1.0, seed).any()


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--random-range-ratio", "1.5", "--model", "m"], "--random-range-ratio must be in [0, 1)"),
    (["--endpoint", "/v1/embeddings"], "invalid choice"),
    (["--goodput", "latency:5"], "--goodput 'latency:5'"),
    (["--tokenizer", "/nonexistent/tok"], "no such file or directory"),
    (["--base-url", "localhost:8000"], "must start with http://"),
    (["--max-concurrency", "x"], "invalid int value"),
    (["--nonsense"], "unrecognized arguments"),
])
def test_bad_flags_one_line_error(argv, message, capsys, server):
    argv = argv if "--base-url" in argv else ["--base-url", server, *argv]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_failing_server_is_one_line_error(server, plan_dir, capsys):
    rc = main(["--base-url", server, "--model", "no-such-model", "--tokenizer", str(plan_dir), "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "test request" in err and "HTTP 404" in err, err


def stubborn_app():
    """An OpenAI-shaped server that always stops after two tokens (ignores ignore_eos) and counts one token per word
    in /tokenize: what bench-serve must notice and report."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def tokenize(request):
        body = await request.json()
        return JSONResponse({"count": len(body["prompt"].split()), "tokens": []})

    async def models(request):
        return JSONResponse({"data": [{"id": "stubborn"}]})

    async def completions(request):
        body = await request.json()
        n_in = len(body["prompt"].split())

        async def events():
            for i, (text, reason) in enumerate((("a", None), (" b", "stop"))):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': reason}]})}\n\n"
            usage = {"prompt_tokens": n_in, "completion_tokens": 2, "total_tokens": n_in + 2}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"]), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_server_that_ignores_ignore_eos_is_reported(tmp_path, capsys, ignore_eos):
    out = tmp_path / "r.json"
    with LiveServer(stubborn_app()) as url:
        rc = main(["--base-url", url, "--num-prompts", "5", "--random-input-len", "12", "--random-output-len", "8",
                   "--save-result", str(out), "--disable-tqdm"] + ([] if ignore_eos else ["--no-ignore-eos"]))
    assert rc == 0, capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["token_counter"] == f"server {url}/tokenize" and r["input_lens"] == [12] * 5
    assert r["output_lens"] == [2] * 5 and r["ignore_eos"] is ignore_eos
    assert r["ignore_eos_violations"] == (5 if ignore_eos else None)
    assert ("does not honor ignore_eos" in capsys.readouterr().out) is ignore_eos
