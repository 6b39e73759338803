"""The <think> parser: whole-text and streamed parsing agree with a direct reference on random texts and splits."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fake_engine import FakeTokenizer
from xserv_aot.server.reasoning import (ReasoningParser, prompt_opens_reasoning, split_reasoning,
                                        template_uses_thinking)

PIECES = ["<think>", "</think>", "<", "</", "<th", "think", ">", "/", "\n", "\n\n", " ", "a", "b", "xyz"]


def reference(text: str, opens: bool) -> tuple[str | None, str]:
    """Direct statement of the rule: an optional leading <think> (after whitespace) or a prompt-opened block
    runs to the first </think>; newlines hugging the markers are dropped."""
    if not opens:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return None, text
        text = head[len("<think>"):]
    if "</think>" not in text:
        return text.strip("\n"), ""
    reasoning, content = text.split("</think>", 1)
    return reasoning.strip("\n"), content.lstrip("\n")


def streamed(parts: list[str], opens: bool) -> tuple[str | None, str]:
    parser, r, c = ReasoningParser(opens), [], []
    for p in parts:
        dr, dc = parser.feed(p)
        r.append(dr)
        c.append(dc)
    dr, dc = parser.flush()
    return ("".join(r) + dr if parser.saw_reasoning else None), "".join(c) + dc


@pytest.mark.parametrize("text,opens,expected", [
    ("<think>\nhmm\n</think>\n\nHello", False, ("hmm", "Hello")),
    ("Hello <think>x</think>", False, (None, "Hello <think>x</think>")),
    ("hmm, so\n</think>\n\nAnswer", True, ("hmm, so", "Answer")),
    ("still thinking", True, ("still thinking", "")),
    ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),
    ("<thin", False, (None, "<thin")),
])
def test_examples(text, opens, expected):
    assert split_reasoning(text, opens) == expected == reference(text, opens)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.booleans(), st.data())
def test_any_split_matches_reference(pieces, opens, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(parts, opens) == reference(text, opens) == split_reasoning(text, opens)


def test_one_char_deltas_never_leak_a_marker():
    text = "<think>\nplan it\n</think>\n\nThe answer"
    parser, seen = ReasoningParser(), []
    for ch in text:
        seen.append(parser.feed(ch))
    seen.append(parser.flush())
    assert all("<" not in r and "<" not in c for r, c in seen)
    assert "".join(r for r, _ in seen) == "plan it" and "".join(c for _, c in seen) == "The answer"


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_template_detection_fake():
    assert template_uses_thinking(FakeTokenizer(thinking=True))
    assert not template_uses_thinking(FakeTokenizer(thinking=False))
    assert not template_uses_thinking(object())


def test_qwen3_template_with_transformers(tmp_path):
    """The real Qwen3 template (rendered by transformers, not by us): thinking on leaves generation outside
    reasoning (the model writes <think>), enable_thinking=False closes an empty block in the prompt."""
    from tests.conftest import ASSETS, ensure_assets
    ensure_assets()
    transformers = pytest.importorskip("transformers")
    src = ASSETS / "qwen3-tokenizer"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]

    class T:
        chat_template = template
    assert template_uses_thinking(T())
    msgs = [{"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert not prompt_opens_reasoning(on) and not prompt_opens_reasoning(off)
    assert off.endswith("</think>\n\n")
    assert split_reasoning("<think>\nwhy\n</think>\n\nbecause", prompt_opens_reasoning(on)) == ("why", "because")
