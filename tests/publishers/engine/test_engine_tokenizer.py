"""The simulator's tokenizer: deterministic everywhere, prefix-stable, realistic lengths."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from publishers.engine.tokenizer import SPECIAL_TOKENS, Tokenizer, split_pieces

REPO = Path(__file__).resolve().parents[3]
ENGLISH = (
    "In computing, a cache is a hardware or software component that stores data so that "
    "future requests for that data can be served faster; the data stored in a cache might "
    "be the result of an earlier computation or a copy of data stored elsewhere. A cache hit "
    "occurs when the requested data can be found in a cache, while a cache miss occurs when "
    "it cannot. Cache hits are served by reading data from the cache, which is faster than "
    "recomputing a result or reading from a slower data store; thus, the more requests that "
    "can be served from the cache, the faster the system performs."
)
ALPHABET = "abcXYZ éü中文 0123456789 .,;!?-_'\"()[]{}<>|/\\\n\t  "


def random_text(rng: random.Random, length: int) -> str:
    parts = [rng.choice(ALPHABET) for _ in range(length)]
    if rng.random() < 0.5:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(SPECIAL_TOKENS))
    return "".join(parts)


def test_same_text_same_ids_across_instances() -> None:
    assert Tokenizer().encode(ENGLISH) == Tokenizer().encode(ENGLISH)


@pytest.mark.parametrize("hash_seed", ["0", "12345", "random"])
def test_same_ids_in_another_process(hash_seed: str) -> None:
    """No salted ``hash()``: a process with another PYTHONHASHSEED agrees."""
    code = (
        "import json, sys; from publishers.engine.tokenizer import Tokenizer; "
        "print(json.dumps(Tokenizer().encode(sys.stdin.read())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=ENGLISH,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=30,
        check=True,
    )
    assert json.loads(result.stdout) == Tokenizer().encode(ENGLISH)


def test_pieces_cover_the_text() -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randrange(80))
        assert "".join(split_pieces(text)) == text


def test_prefix_property() -> None:
    """A text and its extension share every token before the text's last piece."""
    tokenizer = Tokenizer()
    rng = random.Random(2)
    for _ in range(500):
        text = random_text(rng, rng.randrange(1, 60))
        cut = rng.randrange(1, len(text) + 1)
        if any(0 < cut - text.find(s) < len(s) for s in SPECIAL_TOKENS if s in text):
            continue  # cutting inside a special token splits it, as with any tokenizer
        head, extended = text[:cut], tokenizer.encode(text)
        stable = tokenizer.encode("".join(split_pieces(head)[:-1]))
        assert tokenizer.encode(head)[: len(stable)] == stable
        assert extended[: len(stable)] == stable


def test_chat_turns_extend_the_previous_prompt() -> None:
    """Turn n's prompt plus its generated ids is a token prefix of turn n+1's prompt, so an
    engine's cached prompt and decode blocks are hit by the next turn."""
    tokenizer = Tokenizer()
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": ENGLISH},
    ]
    rng = random.Random(3)
    for _ in range(3):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        generated = [rng.randrange(tokenizer.num_ordinary) for _ in range(40)]
        messages.append({"role": "assistant", "content": tokenizer.decode(generated)})
        messages.append({"role": "user", "content": "Tell me more, please."})
        next_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        assert next_prompt[: len(prompt) + len(generated)] == prompt + generated


def test_about_four_characters_per_token() -> None:
    characters_per_token = len(ENGLISH) / len(Tokenizer().encode(ENGLISH))
    assert 3.5 <= characters_per_token <= 4.5


def test_decode_round_trip_of_generated_ids() -> None:
    tokenizer = Tokenizer()
    rng = random.Random(4)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(2000)]
    ids += list(tokenizer.special_ids.values())
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text) == ids


def test_vocabulary_size() -> None:
    """Ids stay in range for any vocabulary; the chat markers are single tokens at the top."""
    for vocab_size in (1000, 32_000, 151_936):
        tokenizer = Tokenizer(vocab_size)
        ids = tokenizer.encode(ENGLISH + "".join(SPECIAL_TOKENS))
        assert all(0 <= token < vocab_size for token in ids)
        assert ids[-3:] == [vocab_size - 3, vocab_size - 2, vocab_size - 1]
        assert tokenizer.encode(tokenizer.decode(ids[:-3])) == ids[:-3]
    with pytest.raises(ValueError):
        Tokenizer(50)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(1000).decode([1000])


def test_chat_template() -> None:
    tokenizer = Tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi\n!<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "message",
    [
        {"content": "no role"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": [{"type": "text"}]},
        {"role": "user", "content": 42},
    ],
)
def test_chat_template_rejects(message: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Tokenizer().apply_chat_template([message])
