"""Text prompts carry the trace's structure through the engines' tokenizer exactly.

What a router comparison rests on: every router gets the same text, and the engines turn it
back into the trace's tokens, so hits and block boundaries are the trace's whichever router
sends it and whichever tokenizer (the simulator's stand-in or an HF one) the engines run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from bench.text_prompts import TRACE_TOKEN_VALUES, checked, hf_words, stand_in_words
from bench.trace_sim import TRACE_BLOCK_SIZE, TraceRequest, block_tokens, prompt_tokens
from fleet.tiny_model import write_tiny_model
from publishers.engine.tokenizer import Tokenizer


def request(hash_ids: list[int], input_length: int) -> TraceRequest:
    return TraceRequest(0, 0.0, input_length, 1, tuple(hash_ids))


def test_stand_in_text_tokenizes_back_to_the_trace_tokens() -> None:
    words, tokenizer = stand_in_words(), Tokenizer()
    tokens = prompt_tokens(request([7, 8, 9], 2 * TRACE_BLOCK_SIZE + 100))
    assert tokenizer.encode(words.text(tokens)) == tokens


def test_equal_hash_prefixes_give_equal_text_prefixes() -> None:
    words = stand_in_words()
    shorter = words.text(prompt_tokens(request([1, 2], 2 * TRACE_BLOCK_SIZE)))
    longer = words.text(prompt_tokens(request([1, 2, 3], 3 * TRACE_BLOCK_SIZE)))
    other = words.text(prompt_tokens(request([1, 4], 2 * TRACE_BLOCK_SIZE)))
    assert longer.startswith(shorter)
    block = len(words.text(block_tokens(1)))
    assert other[:block] == shorter[:block] and other[block:] != shorter[block:]


def test_an_hf_tokenizer_gives_512_tokens_per_block(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path / "tiny")
    words = hf_words(directory)
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    text = words.text(prompt_tokens(request([5, 6], 2 * TRACE_BLOCK_SIZE)))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == 2 * TRACE_BLOCK_SIZE
    again = words.text(prompt_tokens(request([5, 6, 11], 3 * TRACE_BLOCK_SIZE)))
    assert tokenizer.encode(again, add_special_tokens=False).ids[: len(ids)] == ids


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        hf_words(tmp_path)


def test_tables_that_would_move_block_boundaries_are_refused() -> None:
    words = [f" w{i}" for i in range(TRACE_TOKEN_VALUES)]
    with pytest.raises(ValueError, match="need 256"):
        checked(words[:10], "short", lambda text: [0])
    with pytest.raises(ValueError, match="exactly one token"):
        checked(words, "bytes", lambda text: list(text.encode()))
    with pytest.raises(ValueError, match="word by word"):  # one token per word, one in all
        checked(words, "whole", lambda text: [len(text)])
