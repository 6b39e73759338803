"""One request inside the engine: its tokens, KV bookkeeping, sampling state and stop-string text buffer.

Invariant: token_ids = prompt + outputs; KV exists for token_ids[:num_computed_tokens]. A step schedules
token_ids[num_computed_tokens:num_computed_tokens + n]; when that reaches num_tokens, the step samples the next token.
"""
from __future__ import annotations

import enum

from xserv_aot.engine.api import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 detokenizer=None):
        self.request_id = request_id
        self.token_ids: list[int] = [int(t) for t in prompt_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = int(seed)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []        # chained hashes of the leading full, computed blocks
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0                 # tokens served from the prefix cache at the last allocate
        self.num_prompt_cached_tokens: int | None = None   # same, at first admission (reported to the client)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.detokenizer = detokenizer
        self.matcher = None                        # engine.grammar.Matcher when params.guided is set
        self.fork_parent: Sequence | None = None   # an earlier sequence with the same prompt (scheduler.add)
        self._held_text = ""                       # text that may be the start of a stop string

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def feed_text(self, delta: str) -> tuple[str, bool]:
        """Add detokenized text; return (text safe to emit, stop string hit). Stop text itself is never emitted."""
        buf = self._held_text + delta
        stops = [s for s in self.params.stop if s]
        if not stops:
            self._held_text = ""
            return buf, False
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            self._held_text = ""
            return buf[:min(hits)], True
        hold = 0
        for k in range(min(len(buf), max(len(s) for s in stops) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in stops):
                hold = k
                break
        self._held_text = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush_text(self) -> str:
        """At finish (not by stop string): release held text plus whatever the detokenizer still buffers."""
        tail = self.detokenizer.flush() if self.detokenizer is not None else ""
        text, hit = self.feed_text(tail)
        if not hit:
            text += self._held_text
        self._held_text = ""
        return text

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
