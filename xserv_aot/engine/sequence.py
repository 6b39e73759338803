"""One request inside the engine: its tokens, KV bookkeeping, sampling state and text output.

Invariant: token_ids = prompt + outputs; KV exists for token_ids[:num_computed_tokens]. A step schedules
token_ids[num_computed_tokens:num_computed_tokens + n]; when that reaches num_tokens, the step samples the next token.
That token is appended as a placeholder when the step is launched and resolved when its result arrives (the last
num_pending tokens are placeholders; with overlapped steps one can be the input of the next step already).
"""
from __future__ import annotations

import enum

from xserv_aot.engine.api import SamplingParams
from xserv_aot.engine.text_output import TextOutput


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 detokenizer=None, stop_ids: frozenset[int] | None = None):
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
        self.text = TextOutput(detokenizer, params.stop, stop_ids)
        self.needs_host_sampling = params.needs_host_sampling    # with grammar masks: set by Scheduler.add
        self.row: int | None = None                # persistent batch row while running (scheduler-assigned)
        self.num_blocks_sent = 0                   # block ids the runner side knows for this row
        self.num_pending = 0                       # trailing placeholder tokens (sampled on the device, not yet seen)
        self.matcher = None                        # engine.grammar.Matcher when params.guided is set
        self.fork_parent: Sequence | None = None   # an earlier sequence with the same prompt (scheduler.add)

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

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_output_tokens - self.num_pending

    @property
    def known_output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def append_placeholder(self) -> None:
        self.token_ids.append(-1)
        self.num_pending += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """The oldest placeholder becomes token_id."""
        assert self.num_pending > 0, f"{self.request_id}: no placeholder to resolve"
        self.token_ids[len(self.token_ids) - self.num_pending] = int(token_id)
        self.num_pending -= 1

    def drop_pending(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
