"""The engine's failure policy: what a failed step ends, and when the engine gives up for good.

When step() raises, step_or_recover calls recover(error). The requests of the failed step end with finish_reason
"error", the others restart from their tokens so far on a reset KV pool. A successful step resets the failure
count; after `max_consecutive_failures` failed steps in a row (with no success in between, idle time included) the
engine has failed permanently: every open request ends with "error", add_request raises EngineFailedError, and
healthy is False for good. A single failed step leaves healthy True (stats().last_error and consecutive_failures say
what happened). FailurePolicy is a mixin of LLMEngine: its counters are the engine's own attributes.
"""
from __future__ import annotations

import logging

from xserv_aot.engine.api import RequestOutput

log = logging.getLogger(__name__)


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class FailurePolicy:
    """Uses the engine's step, _inflight, _running, _seqs, scheduler and _output."""

    def _init_failures(self, max_consecutive_failures: int) -> None:
        if not (isinstance(max_consecutive_failures, int) and max_consecutive_failures >= 1):
            raise ValueError(f"max_consecutive_failures must be an integer >= 1, got {max_consecutive_failures!r}")
        self.max_consecutive_failures = max_consecutive_failures
        self.failed: str | None = None                 # set when the engine has failed permanently
        self.consecutive_failures = 0
        self.num_step_failures = 0
        self.last_error: str | None = None

    def step_or_recover(self) -> list[RequestOutput]:
        """One step; when it raises, the failure policy (recover) decides which requests end."""
        try:
            return self.step()
        except Exception as e:
            log.exception("engine step failed")
            return self.recover(f"engine step failed: {one_line(e)}")

    def recover(self, error: str) -> list[RequestOutput]:
        """After step() raised: the requests of the failed step end with finish_reason "error" (all requests when
        scheduling itself failed); the others restart from their tokens so far on a reset KV pool, unless this was
        the max_consecutive_failures-th failure in a row: then every open request ends with "error" too."""
        steps, self._inflight, self._running = self._inflight, [], None
        affected = ([s for o in steps for s in o.seqs + o.failed] if steps is not None
                    else list(self._seqs.values()))
        for seq in self._seqs.values():
            seq.drop_pending()                         # survivors restart from the tokens seen so far
        outputs, seen = [], set()
        for seq in affected:
            if seq.request_id in seen:
                continue
            seen.add(seq.request_id)
            if self._seqs.get(seq.request_id) is seq:
                del self._seqs[seq.request_id]
            seq.finish_reason, seq.error = "error", error
            outputs.append(self._output(seq, [], ""))
        self.scheduler.recover(affected)
        return outputs + self._count_failure(error)

    def _count_failure(self, error: str) -> list[RequestOutput]:
        """One more failed step (a raised step, or one whose logits were not finite); the
        max_consecutive_failures-th in a row fails the engine for good, ending every open request."""
        outputs = []
        self.num_step_failures += 1
        self.consecutive_failures += 1
        self.last_error = error
        if self.consecutive_failures >= self.max_consecutive_failures:
            self.failed = (f"engine failed permanently after {self.consecutive_failures} consecutive step "
                           f"failures; last: {error}")
            for seq in list(self._seqs.values()):
                del self._seqs[seq.request_id]
                self.scheduler.finish(seq, "error", self.failed)
                outputs.append(self._output(seq, [], ""))
        return outputs

    @property
    def healthy(self) -> bool:
        return self.failed is None
