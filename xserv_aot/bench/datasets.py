"""Benchmark prompts generated offline from a seed, with input lengths exact in the model's tokens.

A prompt is a run of space-led English words that are each a single token of the model's tokenizer (" river",
" violet", ...); byte-level BPE never merges across the space, so a prompt of n such words is n tokens plus the
tokenizer's special tokens (BOS). Every prompt is re-counted and redrawn if the count is off.

Datasets (lengths in tokens):
- random: input uniform in [L_in (1 - r), L_in (1 + r)], output likewise around L_out (r = --random-range-ratio).
- sharegpt-synthetic: a long-tailed, ShareGPT-like shape: input ~ LogNormal(ln 160, 1.0), output ~
  LogNormal(ln 200, 0.9), rounded; input clipped to [4, M / 2], output to [4, M - input] (M = --sharegpt-max-len,
  default 2048). Synthetic: no conversation text is used, only this length distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHAREGPT_INPUT = (np.log(160.0), 1.0)        # (mu, sigma) of ln(tokens)
SHAREGPT_OUTPUT = (np.log(200.0), 0.9)
MIN_LEN = 4
MIN_WORDS = 16                               # fewer single-token words than this: lengths cannot be made exact
REDRAWS = 8

WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there been one all we their has would when if so no what up out who more do said will about
can them into only other new some could time these two may then first any like now my over such our man me even
most made after also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long here get both between life
being under never day same another know while last might great old year off come since against go came right used
take three house water river cloud harbor signal orbit meadow lantern garden market winter summer window table
paper letter music story city town road field light night morning evening paint stone glass metal silver gold green
blue black white brown small large short quick slow warm cold bright dark open close early late happy simple plain
deep wide high low near far hard soft clear heavy north south east west voice point party power money order
family group number system program question problem service area point place case week company part hand eye
fact""".split()


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int              # tokens, as counted by the token counter (the server's own count may add a template)
    expected_output_len: int


def parse_dataset_lengths(name: str, num_prompts: int, seed: int, *, input_len: int = 1024, output_len: int = 128,
                          range_ratio: float = 0.0, sharegpt_max_len: int = 2048) -> list[tuple[int, int]]:
    """[(input_len, output_len)] * num_prompts drawn with numpy's default_rng(seed)."""
    rng = np.random.default_rng(seed)
    if name == "random":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
        if input_len < 1 or output_len < 1:
            raise ValueError(f"--random-input-len and --random-output-len must be >= 1, got {input_len}, {output_len}")
        ins = rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1, num_prompts)
        outs = rng.integers(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)) + 1, num_prompts)
        return [(max(1, int(i)), max(1, int(o))) for i, o in zip(ins, outs)]
    if name == "sharegpt-synthetic":
        if sharegpt_max_len < 4 * MIN_LEN:
            raise ValueError(f"--sharegpt-max-len must be >= {4 * MIN_LEN}, got {sharegpt_max_len}")
        ins = np.rint(rng.lognormal(*SHAREGPT_INPUT, num_prompts)).astype(np.int64)
        outs = np.rint(rng.lognormal(*SHAREGPT_OUTPUT, num_prompts)).astype(np.int64)
        ins = np.clip(ins, MIN_LEN, sharegpt_max_len // 2)
        return [(int(i), int(np.clip(o, MIN_LEN, sharegpt_max_len - i))) for i, o in zip(ins, outs)]
    raise ValueError(f"unknown --dataset-name {name!r} (random | sharegpt-synthetic)")


class PromptBuilder:
    """Prompts of an exact token count under `counter` (an object with count(texts, add_special_tokens) -> list[int])."""

    def __init__(self, counter, seed: int):
        self.counter = counter
        self.rng = np.random.default_rng([seed, 1])
        cands = [" " + w for w in dict.fromkeys(WORDS)]
        self.words = [w for w, n in zip(cands, counter.count(cands, add_special_tokens=False)) if n == 1]
        if len(self.words) < MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(self.words)} single-token English words; "
                             "cannot build prompts of exact length")
        self.num_special = counter.count(["".join(self.words[:2])], add_special_tokens=True)[0] - 2

    def build(self, lengths: list[tuple[int, int]]) -> list[SampleRequest]:
        texts, wanted = [], []
        for n_in, _ in lengths:
            if n_in <= self.num_special:
                raise ValueError(f"input length {n_in} leaves no room next to {self.num_special} special tokens")
            texts.append(self._draw(n_in - self.num_special))
            wanted.append(n_in)
        for _ in range(REDRAWS):
            counts = self.counter.count(texts, add_special_tokens=True)
            bad = [i for i, (c, n) in enumerate(zip(counts, wanted)) if c != n]
            if not bad:
                return [SampleRequest(t, n, o) for t, n, (_, o) in zip(texts, wanted, lengths)]
            for i in bad:
                texts[i] = self._draw(wanted[i] - self.num_special)
        raise ValueError(f"could not build prompts of exact length (e.g. {wanted[bad[0]]} tokens counted as "
                         f"{counts[bad[0]]}) with this tokenizer")

    def _draw(self, n_words: int) -> str:
        return "".join(self.rng.choice(self.words, n_words))
