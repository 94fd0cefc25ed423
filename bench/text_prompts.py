"""Text prompts for the trace replay: every router gets the same text, whatever it parses.

sglang-router only takes string prompts, and a router that tokenizes (ours through an
engine's ``/tokenize`` or in process, vllm-router through ``/v1/completions/render``) should
pay for it as it would in service. So the replay sends text, built so that the engines'
tokenizer gives back the trace's structure exactly:

- a trace token (``trace_sim.block_tokens``: one byte, 0-255) becomes one *word*, a piece
  with a leading space that the tokenizer maps to a single id, and a prompt is its words
  concatenated. Words split at their leading space under both the simulator's stand-in
  tokenizer and byte-level BPEs, so a prompt of N trace tokens is N engine tokens, and each
  512-token hash_id block is 512 tokens;
- equal hash_id prefixes therefore give equal text prefixes and equal token prefixes, which
  is all prefix caching and every cache-aware router rely on.

``stand_in_words`` is the simulator's default tokenizer (its ``decode`` of each id, which
encodes back to that id); ``hf_words`` picks single-token words from an HF ``tokenizer.json``
(the tiny model's, or any HF model directory's) for engines run with that tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from publishers.engine.tokenizer import Tokenizer

TRACE_TOKEN_VALUES = 256  # trace_sim.block_tokens draws one byte per token


@dataclass(frozen=True, slots=True)
class WordTable:
    """``words[t]``: the text of trace token ``t``, one engine token with a leading space."""

    words: tuple[str, ...]
    source: str  # which tokenizer, for the report

    def text(self, tokens: Sequence[int]) -> str:
        return "".join(self.words[token] for token in tokens)


def checked(words: Sequence[str], source: str, encode: Callable[[str], list[int]]) -> WordTable:
    """The table, once ``encode`` shows that each word is one token and that the words
    concatenated are as many tokens as words (so a prompt's length and its block boundaries
    survive tokenization); ValueError otherwise."""
    if len(words) < TRACE_TOKEN_VALUES:
        raise ValueError(f"{source}: {len(words)} single-token words, need {TRACE_TOKEN_VALUES}")
    table = WordTable(tuple(words[:TRACE_TOKEN_VALUES]), source)
    ids = [encode(word) for word in table.words]
    if any(len(word_ids) != 1 for word_ids in ids):
        raise ValueError(f"{source}: a word does not encode to exactly one token")
    sample = list(range(TRACE_TOKEN_VALUES)) * 2
    if encode(table.text(sample)) != [ids[token][0] for token in sample]:
        raise ValueError(f"{source}: concatenated words do not tokenize word by word")
    return table


def stand_in_words() -> WordTable:
    """The simulator's stand-in tokenizer: trace token t is its pseudo-word for id t."""
    tokenizer = Tokenizer()
    words = [tokenizer.decode([token]) for token in range(TRACE_TOKEN_VALUES)]
    return checked(words, "stand-in", tokenizer.encode)


def hf_words(directory: Path) -> WordTable:
    """Single-token ASCII words with a leading space from ``directory/tokenizer.json``, in id
    order (deterministic: the same table on every run). Needs the ``tokenizers`` package."""
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no tokenizer.json (an HF model directory has one)")
    tokenizer = HFTokenizer.from_file(str(path))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    words: dict[str, None] = {}  # ordered, without repeats
    for token_id in sorted(tokenizer.get_vocab().values()):
        word = tokenizer.decode([token_id])
        if word[:1] == " " and word[1:].isascii() and word[1:].isalpha() and len(encode(word)) == 1:
            words[word] = None
            if len(words) == TRACE_TOKEN_VALUES:
                break
    return checked(list(words), str(directory), encode)
