"""The wire between the API server process and the engine core process: msgspec structs, msgpack-encoded.

Only token ids and small records cross: no text (the API process detokenizes and checks stop strings), no
logits. Structs are array-like (no field names on the wire) and tagged, so one typed decoder validates every
message; anything that does not decode to a known message of the right types is rejected (MessageError).

API -> core: AddRequest, Abort, Utility, Shutdown.  core -> API: Ready, Outputs, UtilityResult, Failed, Bye.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from xserv_aot.engine.api import EngineStats, RequestOutput, SamplingParams, TokenLogprob


class _Msg(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    pass


class AddRequest(_Msg):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams               # stop strings stay in the API process


class Abort(_Msg):
    request_ids: list[str]


class Utility(_Msg):
    call_id: int
    name: str                            # "debug_state" | "runner" (a method the runner lists in remote_methods)
    args: list[Any]


class Shutdown(_Msg):
    pass


class Ready(_Msg):
    pid: int


class WireOutput(_Msg):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


class Outputs(_Msg):
    outputs: list[WireOutput]
    stats: EngineStats
    num_adds_received: int               # AddRequests the core has taken in since it started


class UtilityResult(_Msg):
    call_id: int
    value: Any = None
    error: str | None = None


class Failed(_Msg):
    error: str                           # the engine could not start (one line)


class Bye(_Msg):
    pass


ToCore = Union[AddRequest, Abort, Utility, Shutdown]
FromCore = Union[Ready, Outputs, UtilityResult, Failed, Bye]


class MessageError(ValueError):
    """A message that is not valid msgpack of a known message type."""


class Codec:
    def __init__(self, decodes):
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(decodes)

    def encode(self, msg) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes):
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageError(f"malformed message ({len(data)} bytes): {' '.join(str(e).split())[:200]}") from None


def core_codec() -> Codec:
    """The engine core's side: decodes what the API process sends."""
    return Codec(ToCore)


def client_codec() -> Codec:
    return Codec(FromCore)


def to_wire(o: RequestOutput) -> WireOutput:
    return WireOutput(o.request_id, o.new_token_ids, o.finish_reason, o.num_prompt_tokens, o.num_generated_tokens,
                      o.num_cached_tokens, o.error, o.logprobs)
