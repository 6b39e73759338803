"""The synchronous engine: requests in, one step at a time (schedule, run, postprocess), RequestOutput deltas out.

Not thread-safe: one thread owns an LLMEngine (AsyncEngine runs it in its engine thread).
Stop conditions, checked after each new token: EOS (unless ignore_eos) or a stop_token_id -> "stop" (the token
is returned as an id but not detokenized); a stop string -> "stop" (text from the stop string on is dropped);
max_tokens or max_seq_len -> "length".

Failures (step_or_recover, recover, healthy and the failure counters): engine/failures.py, a mixin of LLMEngine.
"""
from __future__ import annotations

import random
from typing import Callable

import numpy as np

from xserv_aot.config import BuildConfig
from xserv_aot.engine.api import (EngineFailedError, EngineStats, InvalidRequestError, RequestOutput, SamplingParams,
                                  TokenLogprob)
from xserv_aot.engine.failures import FailurePolicy, one_line
from xserv_aot.engine.grammar import GrammarCompiler, GrammarError, allowed_ids, stage_masks
from xserv_aot.engine.request_checks import check_guided, check_request
from xserv_aot.engine.sampler import sample_token
from xserv_aot.engine.scheduler import Scheduler, SchedulerOutput
from xserv_aot.engine.sequence import Sequence
from xserv_aot.runtime.batch import NONFINITE_ID, StepResult
from xserv_aot.runtime.numpy_ops import no_token
from xserv_aot.runtime.input_batch import InputBatch
from xserv_aot.runtime.nvtx import ranges as nvtx_ranges

__all__ = ["LLMEngine", "NONFINITE_ERROR", "one_line"]     # one_line lives in engine/failures.py
NONFINITE_ERROR = "the model produced non-finite logits (NaN/Inf); no token was sampled"


def _default_detokenizer(tokenizer):
    from xserv_aot.detokenizer import IncrementalDetokenizer
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=True)


class LLMEngine(FailurePolicy):
    def __init__(self, runner, tokenizer=None, *, build: BuildConfig | None = None,
                 eos_token_ids: list[int] | None = None, vocab_size: int | None = None,
                 enable_prefix_caching: bool = True, detokenizer_factory: Callable | None = None,
                 seed: int | None = None, max_consecutive_failures: int = 3, overlap: bool | None = None,
                 grammar_tokenizer=None):
        """build and vocab_size default to runner.plan's; eos_token_ids to the model's plus the tokenizer's.
        tokenizer None: ids only, no text. detokenizer_factory(tokenizer) -> object with add(id) -> str, flush() -> str
        (default: xserv_aot.detokenizer.IncrementalDetokenizer).
        max_consecutive_failures: failed steps in a row after which the engine gives up for good (>= 1).
        overlap: launch step N+1 before step N's tokens are seen (runner.launch/wait, plans with resolve_input_ids);
        None: when the runner says it overlaps (runner.overlaps). Outputs are the same either way; a step in which a
        row with a grammar samples completes at once (its matcher must see the token before the next mask).
        grammar_tokenizer: compiles structured-output grammars when tokenizer is None (the ids-only engine core)."""
        self._init_failures(max_consecutive_failures)
        plan = getattr(runner, "plan", None)
        model = getattr(plan, "model", None)
        self.runner = runner
        self.tokenizer = tokenizer
        self.build = build if build is not None else plan.build
        if eos_token_ids is None:
            eos_token_ids = [*(getattr(model, "eos_token_ids", None) or []),
                             *(getattr(tokenizer, "eos_token_ids", None) or [])]
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size if vocab_size is not None else getattr(model, "vocab_size", None)
        self.max_seq_len = self.build.max_seq_len
        self.grammars = GrammarCompiler(grammar_tokenizer or tokenizer, self.vocab_size or 0, self.eos_token_ids)
        arena = getattr(plan, "arena", None) or {}
        self.bitmask_words = arena["token_bitmask"].shape[1] if "token_bitmask" in arena else 0
        self.scheduler = Scheduler(self.build, enable_prefix_caching, device_masks=bool(self.bitmask_words))
        self.input_batch = InputBatch(self.build)
        self._detokenizer_factory = detokenizer_factory or _default_detokenizer
        self._seqs: dict[str, Sequence] = {}
        self._rng = random.Random(seed)
        self._num_added = 0
        self.overlap = (bool(getattr(runner, "overlaps", False)) if overlap is None else overlap)
        if self.overlap and not hasattr(runner, "launch"):
            raise ValueError(f"overlap needs a runner with launch/wait; {type(runner).__name__} has none")
        self._inflight: list[SchedulerOutput] | None = []   # steps whose requests a failure ends (None: all)
        self._running: tuple | None = None             # (out, handle, record) of the step still on the device
        self._nonfinite = 0                            # rows of this step whose logits were not finite
        self.on_scheduled: Callable[[], None] | None = None    # called between schedule and run (stats)
        self.nvtx = nvtx_ranges(False)                 # runtime.nvtx.ranges(True): NVTX ranges around each stage

    # requests

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self.build, self.vocab_size, self.tokenizer is not None)
        check_guided(params, self.grammars)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params if params is not None else SamplingParams()
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        self.check_request(prompt_ids, params)
        seed = self._rng.getrandbits(63) if params.seed is None else int(params.seed) % 2 ** 63
        detok = self._detokenizer_factory(self.tokenizer) if self.tokenizer is not None else None
        seq = Sequence(request_id, prompt_ids, params, seed, detok, self.stop_ids(params))
        if params.guided is not None:
            seq.matcher = self.grammars.matcher(params.guided)
        self._num_added += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish the request now (its blocks are freed at once); None when it is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.drop_pending()
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], "")

    def abort_all(self) -> list[RequestOutput]:
        return [o for o in (self.abort(rid) for rid in list(self._seqs)) if o is not None]

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # steps

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step that completed. Overlapped: the step launched
        here runs while the previous one's tokens are checked (a step needing host sampling completes at once).
        NVTX ranges (self.nvtx): schedule, run (prepare + run or launch), postprocess (wait + outputs)."""
        nv = self.nvtx
        self._inflight = None                          # until the schedule succeeds a failure ends every request
        with nv.range("schedule"):
            out = self.scheduler.schedule()
        self._inflight = [out] + ([self._running[0]] if self._running is not None else [])
        if self.on_scheduled is not None:
            self.on_scheduled()
        self._nonfinite = 0
        outputs = [self._finish(seq, [], seq.text.flush(), seq.finish_reason, None) for seq in out.failed]
        with nv.range("run"):
            launched = self._launch(out)
        with nv.range("postprocess"):
            if self._running is not None:
                running, self._running = self._running, None
                outputs += self._complete(*running, latest=out)
            if launched is not None and (not self.overlap or out.update.need_logits or len(out.batch.bitmask_rows)):
                outputs += self._complete(out, *launched, latest=out)
            elif launched is not None:
                self._running = (out, *launched)
        self._inflight = [self._running[0]] if self._running is not None else []
        if self._nonfinite:
            outputs += self._count_failure(NONFINITE_ERROR)
        else:
            self.consecutive_failures = 0
        return outputs

    def _launch(self, out: SchedulerOutput):
        if out.is_empty:
            self.input_batch.apply(out.update)
            return None
        out.batch = self.input_batch.prepare(out.update)
        stage_masks(out, self.bitmask_words)
        handle = self.runner.launch(out.batch) if self.overlap else self.runner.run(out.batch)
        record = self.input_batch.launched()
        self.scheduler.advance(out)
        for seq, samples in zip(out.seqs, out.samples):
            if samples:
                seq.append_placeholder()
        return handle, record

    def _complete(self, out: SchedulerOutput, handle, record, latest: SchedulerOutput) -> list[RequestOutput]:
        """Read out's result; latest (the step launched last) has its inputs all known once out's are resolved."""
        result = self.runner.wait(handle) if self.overlap else handle
        self.input_batch.resolve(record, result.sampled_ids)
        return self.postprocess(out, result, latest)

    def postprocess(self, out: SchedulerOutput, result: StepResult, latest: SchedulerOutput) -> list[RequestOutput]:
        """Resolve the step's placeholders with its tokens; register the blocks out and latest (the step launched
        last) computed, whose tokens are all known now; then check stop conditions, in row order."""
        new, bad, failed = [], [], []
        sampled = np.asarray(result.sampled_ids).reshape(-1)
        for i, seq in enumerate(out.seqs):
            if not out.samples[i] or seq.is_finished:
                continue                                   # mid-prefill chunk, or ended while this step ran
            if seq.matcher is not None and seq.error is not None:
                failed.append(seq)                         # its grammar failed (stage_masks): only it ends
                continue
            if seq.needs_host_sampling:
                if result.logits is None:
                    raise RuntimeError("runner returned no logits for a batch with need_logits set")
                row = np.asarray(result.logits[i])
                if no_token(row):
                    token, lp = NONFINITE_ID, None
                else:
                    try:
                        allowed = allowed_ids(seq, self.vocab_size, self.eos_token_ids)
                    except GrammarError as e:
                        seq.error = str(e)
                        failed.append(seq)
                        continue
                    token, lp = sample_token(row, seq.params, seq.prompt_ids, seq.known_output_ids, seq.seed,
                                             seq.num_known_output_tokens, allowed)
                    self.scheduler.host_token(seq, token)
            else:
                token, lp = int(sampled[i]), None
            if token == NONFINITE_ID:
                bad.append(seq)
                continue
            seq.resolve_placeholder(token)
            new.append((seq, token, lp))
        outputs = [self._fail_nonfinite(seq) for seq in bad]    # before cache: their blocks are never registered
        self.scheduler.cache(out.seqs if latest is out else out.seqs + latest.seqs)
        ended = [self._finish(seq, [], seq.text.flush(), "error", None) for seq in failed]
        return outputs + ended + [self._append(seq, token, lp) for seq, token, lp in new]

    def _fail_nonfinite(self, seq: Sequence) -> RequestOutput:
        """A row whose logits were not finite (the sample op's NONFINITE_ID): the request ends with an error. Under
        overlap the next step already fed NONFINITE_ID forward as its input id (the embedding clamps it); that row's
        result is dropped with the placeholder."""
        self._nonfinite += 1
        seq.error = NONFINITE_ERROR
        return self._finish(seq, [], seq.text.flush(), "error", None)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """Tokens that are not detokenized when they end a request: EOS and stop_token_ids."""
        return self.eos_token_ids | frozenset(int(t) for t in params.stop_token_ids)

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        if seq.matcher is not None:
            seq.matcher.consume(token)                 # allowed by its mask: cannot fail
        text, reason = seq.text.step(token, self.id_finish(seq, token))
        lps = [lp] if lp is not None else None
        if reason is not None:
            return self._finish(seq, [token], text, reason, lps)
        return self._output(seq, [token], text, lps)

    def id_finish(self, seq: Sequence, token: int) -> str | None:
        """The finish decided by ids alone, after token was appended: "stop" (EOS unless ignore_eos, a stop
        token id, or the end of its grammar), "length" (max_tokens or max_seq_len), or None."""
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped:
            return "stop"                              # the grammar is complete (its last token is text)
        if seq.num_known_output_tokens >= p.max_tokens or seq.num_tokens - seq.num_pending >= self.max_seq_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, tokens: list[int], text: str, reason: str, lps) -> RequestOutput:
        self._seqs.pop(seq.request_id, None)
        seq.drop_pending()                             # a token sampled past the stop is never seen
        self.scheduler.finish(seq, reason, seq.error)
        return self._output(seq, tokens, text, lps)

    def _output(self, seq: Sequence, tokens: list[int], text: str, lps=None) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, text, seq.finish_reason, lps, seq.num_prompt_tokens,
                             seq.num_known_output_tokens, seq.num_prompt_cached_tokens or 0, seq.error)

    # reporting

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.num_used_blocks, bm.num_blocks,
                           bm.prefix_cache_queries, bm.prefix_cache_hits, s.num_preemptions, self.healthy,
                           self.consecutive_failures, self.num_step_failures, self.last_error)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; one merged RequestOutput per prompt (all ids, full text), in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        plist = [p if p is not None else SamplingParams() for p in plist]
        for prompt, p in zip(prompts, plist):
            self.check_request(prompt, p)
        ids = [f"generate-{self._num_added + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        merged = {rid: RequestOutput(rid, [], "", logprobs=None) for rid in ids}
        while any(merged[r].finish_reason is None for r in ids):
            for o in self.step():
                if o.request_id in merged:
                    merged[o.request_id].extend(o)
        return [merged[r] for r in ids]
