"""A deterministic stand-in tokenizer: no model files, same ids on every engine and process.

The simulator only needs token ids that behave like a real tokenizer's where it matters for
KV caching and routing:

- *Deterministic everywhere*: text is split into pieces and each piece is mapped by XXH3 of
  its UTF-8 bytes (never Python's salted ``hash()``), so every instance, process and host —
  the router's ``/tokenize`` calls included — agrees on the ids.
- *Prefix-stable*: pieces are matched left to right by a regex whose matches do not depend
  on what follows them (a punctuation run only checks that a chat marker does not start
  next), so a text and its extension share every token before the text's last piece — unless
  the text ends inside a chat marker. A chat history ending at a marker or newline is
  therefore a token prefix of the next turn: what prefix caching on chat relies on.
- *Realistic lengths*: words carry their leading space (`` ?letters``, as GPT/Qwen BPEs),
  digits go in groups of three, and a piece longer than ``MAX_PIECE_CHARS`` is cut into
  chunks from its start, which gives about 4 characters per token on English prose.
- *Decodable*: an ordinary id decodes to a pseudo-word of consonant-vowel syllables that
  spells the id (" bakotu"), and ``encode`` maps such a word back to the same id, so
  ``encode(decode(ids)) == ids``. Generated text sent back in the next chat turn thus
  re-tokenizes to the generated ids and hits the blocks the engine cached while decoding.
- The chat special tokens (``<|im_start|>`` ...) are single tokens at the top of the vocabulary.

``ModelTokenizer`` is the other choice (``--tokenizer DIR``): a model directory's HF tokenizer
and chat template, through the shared tokenizer (``tokenization.tokenizer``), so the
simulator's ids are the ones vLLM serving that model computes and the router, given the
same directory, agrees with every engine without asking.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import product
from pathlib import Path

import xxhash

from tokenization.tokenizer import LocalTokenizer, Unsupported

DEFAULT_VOCAB_SIZE = 151_936  # Qwen2 / Qwen2.5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_PIECE_CHARS = 6  # tuned: 4.0 characters per token on English prose

_SPECIALS = "|".join(re.escape(token) for token in SPECIAL_TOKENS)
_PIECE = re.compile(
    rf"{_SPECIALS}"  # chat markers, one token each
    r"| ?[^\W\d_]+"  # a word with its leading space
    r"| ?\d{1,3}"  # digits in groups of three
    rf"| ?(?:(?!{_SPECIALS})[^\s\w]|_)+"  # punctuation and symbols, stopping at a marker
    r"|\n"  # each newline alone, so a history ending in one is a clean token prefix
    r"|[^\S\n]+"  # other whitespace runs
)
_SYLLABLES = tuple(c + v for c, v in product("bdfghjklmnprstvz", "aeiou"))
_SYLLABLE_VALUES = {syllable: value for value, syllable in enumerate(_SYLLABLES)}
_CACHE_LIMIT = 1 << 16


def split_pieces(text: str) -> list[str]:
    """The pieces ``encode`` maps to tokens; they concatenate back to ``text``."""
    return _PIECE.findall(text)


class Tokenizer:
    """Text <-> ids over a vocabulary of ``vocab_size`` ids, the specials at the top."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size
        self.num_ordinary = vocab_size - len(SPECIAL_TOKENS)
        if self.num_ordinary < len(_SYLLABLES):
            raise ValueError(f"vocab_size must be at least {len(_SYLLABLES) + len(SPECIAL_TOKENS)}")
        self.special_ids = {token: self.num_ordinary + i for i, token in enumerate(SPECIAL_TOKENS)}
        self._specials_by_id = {i: token for token, i in self.special_ids.items()}
        self._syllables_per_word = 1
        while len(_SYLLABLES) ** self._syllables_per_word < self.num_ordinary:
            self._syllables_per_word += 1
        self._piece_ids: dict[str, tuple[int, ...]] = {}

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids (the stand-in has no BOS to add)."""
        return self.encode(text)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool
    ) -> list[int]:
        """A chat's ids; raises ValueError for content it cannot render."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in split_pieces(text):
            piece_ids = self._piece_ids.get(piece)
            if piece_ids is None:
                piece_ids = self._map_piece(piece)
                if len(self._piece_ids) >= _CACHE_LIMIT:
                    self._piece_ids.clear()
                self._piece_ids[piece] = piece_ids
            ids.extend(piece_ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Specials as themselves, every other id as the pseudo-word that encodes back to it.

        Text that was encoded does not come back (pieces are hashed); generated ids do.
        """
        return "".join(self._decode_id(token_id) for token_id in ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True
    ) -> str:
        """ChatML, as Qwen's template (without its default system prompt).

        Content may be a string, None, or a list of OpenAI text parts (joined by newlines,
        as vLLM does for string-format templates); other part types are rejected.
        """
        turns = [
            f"<|im_start|>{_role(message)}\n{_content_text(message.get('content'))}<|im_end|>\n"
            for message in messages
        ]
        if add_generation_prompt:
            turns.append("<|im_start|>assistant\n")
        return "".join(turns)

    def _map_piece(self, piece: str) -> tuple[int, ...]:
        special = self.special_ids.get(piece)
        if special is not None:
            return (special,)
        word_id = self._pseudo_word_id(piece)
        if word_id is not None:
            return (word_id,)
        return tuple(
            xxhash.xxh3_64_intdigest(piece[start : start + MAX_PIECE_CHARS].encode())
            % self.num_ordinary
            for start in range(0, len(piece), MAX_PIECE_CHARS)
        )

    def _pseudo_word_id(self, piece: str) -> int | None:
        """The id a word produced by ``decode`` stands for, None for any other piece."""
        if len(piece) != 1 + 2 * self._syllables_per_word or piece[0] != " ":
            return None
        value = 0
        for start in range(1, len(piece), 2):
            syllable = _SYLLABLE_VALUES.get(piece[start : start + 2])
            if syllable is None:
                return None
            value = value * len(_SYLLABLES) + syllable
        return value if value < self.num_ordinary else None

    def _decode_id(self, token_id: int) -> str:
        special = self._specials_by_id.get(token_id)
        if special is not None:
            return special
        if not 0 <= token_id < self.num_ordinary:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        syllables = []
        for _ in range(self._syllables_per_word):
            token_id, syllable = divmod(token_id, len(_SYLLABLES))
            syllables.append(_SYLLABLES[syllable])
        return " " + "".join(reversed(syllables))


class ModelTokenizer:
    """A model directory's HF tokenizer with the interface the simulator uses."""

    def __init__(self, directory: Path) -> None:
        self._model = LocalTokenizer.load(directory)  # raises ValueError
        self.vocab_size = self._model.vocab_size
        # generated tokens are drawn from every id: a special one decodes to its text,
        # which encodes back to it
        self.num_ordinary = self.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids, special tokens added as vLLM adds them."""
        return self._model.encode(text, add_special_tokens=True)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool
    ) -> list[int]:
        """A chat's ids as vLLM computes them; raises ValueError for what the router's
        tokenizer does not render (vLLM would, differently or with a 400)."""
        try:
            text = self._model.render_chat(list(messages), add_generation_prompt)
        except Unsupported as unsupported:
            raise ValueError(f"the simulator cannot render this chat: {unsupported}") from None
        return self._model.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode(list(ids))


def _role(message: Mapping[str, object]) -> str:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError("every message needs a non-empty string 'role'")
    return role


def _content_text(content: object) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError("message content must be a string, a list of text parts or null")


EngineTokenizer = Tokenizer | ModelTokenizer  # what the simulator's API tokenizes with
