"""Qwen3-style reasoning parser: text between <think> and </think> becomes `reasoning_content`.

One incremental parser serves both streaming (feed each delta) and non-streaming (feed the whole text), so the
two always agree. Markers may be split across deltas: text that could be the start of a marker is held back.
Newlines right after a marker and right before </think> are dropped, as the Qwen3 chat template does when it
renders reasoning_content back into a prompt.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def template_uses_thinking(tokenizer) -> bool:
    """True when the tokenizer's chat template mentions <think> (Qwen3 and its derivatives)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and THINK_START in template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The chat template already put an unclosed <think> into the prompt: generation starts inside reasoning."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    """States: 'start' (a leading <think> may still come), 'reasoning', 'content'."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.saw_reasoning = starts_in_reasoning
        self._buf = ""
        self._strip_lead = starts_in_reasoning   # drop newlines right after a marker

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a text delta; return the (reasoning, content) text that is now certain."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self.state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._enter("reasoning", head[len(THINK_START):])
                    self.saw_reasoning = True
                elif THINK_START.startswith(head):
                    break                                   # maybe the start of <think>: wait
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self._buf.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._lead(self._buf[:end]).rstrip("\n"))
                    self._enter("content", self._buf[end + len(THINK_END):])
                    continue
                keep = _partial_suffix(self._buf, THINK_END)
                ready = self._buf[:len(self._buf) - keep].rstrip("\n")
                reasoning.append(self._lead(ready))
                self._buf = self._buf[len(ready):]
                break
            else:
                content.append(self._lead(self._buf))
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of generation: release held-back text (an unfinished marker is ordinary text)."""
        rest, self._buf = self._buf, ""
        if self.state == "reasoning":
            return self._lead(rest).rstrip("\n"), ""
        return "", (self._lead(rest) if self.state == "content" else rest)

    def _enter(self, state: str, rest: str) -> None:
        self.state, self._buf, self._strip_lead = state, rest, True

    def _lead(self, text: str) -> str:
        if self._strip_lead:
            text = text.lstrip("\n")
            self._strip_lead = not text
        return text


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text form: (reasoning_content or None when there was no <think> block, content)."""
    parser = ReasoningParser(starts_in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.flush()
    return (r1 + r2 if parser.saw_reasoning else None), c1 + c2
