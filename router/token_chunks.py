"""Encoding long prompts in chunks cut at word boundaries, each chunk's ids remembered.

Multi-turn chats and shared system prompts send the same long text prefix again and again,
and HF ``tokenizers`` encodes it from scratch every time (~2 µs a token: 25 ms of CPU for a
12k-token conversation, per turn). Cut at a space between two alphanumeric characters, a
text's tokens are its chunks' tokens end to end for the tokenizers vLLM serves: byte-level
BPE (GPT-2, Llama 3, Qwen), Metaspace (SentencePiece BPE or unigram) and WordPiece all start
a pre-token at such a space and never look across it. Where a cut falls depends only on the
text up to one character past it, so two prompts sharing a prefix share every chunk up to
their last cut inside it; those chunks' ids come from an LRU cache, and only the rest is
encoded (in one batch call, which ``tokenizers`` spreads over its threads).

Exactness is checked, not assumed: ``ChunkedEncoder.create`` compares chunked and whole ids
on probe texts built from the tokenizer's own vocabulary and added tokens, and refuses a
tokenizer where they differ (a normalizer that prepends or strips, as Llama 2's legacy
``tokenizer.json`` does); then every ``AUDIT_EVERY``-th chunked encode is compared with a
whole encode, and a difference turns chunking off for good (the whole ids are returned).
"""

from __future__ import annotations

import logging
import random
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

log = logging.getLogger("router.tokenizer")

CHUNK_CACHE_TOKENS = 2_000_000  # ids kept by default: ~25 MB with their chunks' text
CHUNK_CHARS = 1024  # a chunk ends at the first cut this many characters after its start
AUDIT_EVERY = 64  # one chunked encode in this many is checked against a whole encode
PROBE_CHUNK_CHARS = 1  # the probes cut at every possible place
PROBE_SEEDS = 4


def encode_whole(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # the batch form that skips character offsets: the same ids, ~30% less time
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def cut_points(text: str, every: int) -> list[int]:
    """Chunk boundaries: 0, then the first space at least ``every`` characters after the
    previous cut with an alphanumeric character on each side, ..., ``len(text)``."""
    cuts = [0]
    last = len(text) - 1
    position = every
    while position < last:
        cut = text.find(" ", position, last)
        while cut != -1 and not (text[cut - 1].isalnum() and text[cut + 1].isalnum()):
            cut = text.find(" ", cut + 1, last)
        if cut == -1:
            break
        cuts.append(cut)
        position = cut + every
    cuts.append(len(text))
    return cuts


@dataclass(slots=True)
class ChunkStats:
    """What the encoder did since it started (read by the router's metrics)."""

    reused_tokens: int = 0  # ids that came from the cache
    encoded_tokens: int = 0  # ids the tokenizer computed for chunked texts
    audits: int = 0
    disagreements: int = 0
    cached_tokens: int = 0  # ids the cache holds now


class ChunkedEncoder:
    """A tokenizer's ``encode`` for long texts, reusing the ids of chunks seen before.

    Thread-safe: the router encodes long prompts in worker threads.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_ids: tuple[list[int], list[int]],
        max_cached_tokens: int,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self._before, self._after = special_ids  # what add_special_tokens puts around a text
        self._max_cached_tokens = max_cached_tokens
        self._chunk_chars = chunk_chars
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._calls = 0
        self.active = True
        self.stats = ChunkStats()

    @classmethod
    def create(cls, tokenizer: Tokenizer, max_cached_tokens: int) -> ChunkedEncoder | None:
        """An encoder for ``tokenizer``, or None when chunking cannot give its exact ids
        (logged with the reason)."""
        if tokenizer.truncation or tokenizer.padding:
            log.info("prompts are encoded whole: the tokenizer truncates or pads")
            return None
        special_ids = _special_ids(tokenizer)
        if special_ids is None:
            log.info("prompts are encoded whole: special tokens are not only around the text")
            return None
        encoder = cls(tokenizer, special_ids, max_cached_tokens)
        for text in probe_texts(tokenizer):
            for specials in (True, False):
                whole = encoder.encode_whole(text, specials)
                if encoder.encode_chunks(text, specials, PROBE_CHUNK_CHARS) != whole:
                    log.info("prompts are encoded whole: this tokenizer looks across spaces")
                    return None
        encoder.clear()
        return encoder

    def encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return encode_whole(self._tokenizer, text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``, as ``encode_whole`` gives them."""
        if not self.active or len(text) < 2 * self._chunk_chars:
            return self.encode_whole(text, add_special_tokens)
        ids = self.encode_chunks(text, add_special_tokens, self._chunk_chars)
        with self._lock:
            self._calls += 1
            audit = self._calls % AUDIT_EVERY == 1  # the first, then one in AUDIT_EVERY
        if audit:
            return self._audit(text, add_special_tokens, ids)
        return ids

    def encode_chunks(self, text: str, add_special_tokens: bool, chunk_chars: int) -> list[int]:
        cuts = cut_points(text, chunk_chars)
        chunks = [text[start:end] for start, end in zip(cuts, cuts[1:], strict=False)]
        with self._lock:
            found = [self._cache.get(chunk) for chunk in chunks]
            for chunk, chunk_ids in zip(chunks, found, strict=True):
                if chunk_ids is not None:
                    self._cache.move_to_end(chunk)
        missing = list(dict.fromkeys(c for c, i in zip(chunks, found, strict=True) if i is None))
        encoded = {}
        if missing:
            batch = self._tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            encoded = {chunk: array("I", e.ids) for chunk, e in zip(missing, batch, strict=True)}
        ids = list(self._before) if add_special_tokens else []
        reused = 0
        for chunk, chunk_ids in zip(chunks, found, strict=True):
            if chunk_ids is None:
                ids += encoded[chunk]
            else:
                ids += chunk_ids
                reused += len(chunk_ids)
        if add_special_tokens:
            ids += self._after
        self._remember(encoded, reused)
        return ids

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.stats = ChunkStats()

    def _remember(self, encoded: dict[str, array[int]], reused: int) -> None:
        with self._lock:
            stats = self.stats
            stats.reused_tokens += reused
            for chunk, chunk_ids in encoded.items():
                stats.encoded_tokens += len(chunk_ids)
                if chunk not in self._cache:
                    self._cache[chunk] = chunk_ids
                    stats.cached_tokens += len(chunk_ids)
            while stats.cached_tokens > self._max_cached_tokens and self._cache:
                stats.cached_tokens -= len(self._cache.popitem(last=False)[1])

    def _audit(self, text: str, add_special_tokens: bool, ids: list[int]) -> list[int]:
        whole = self.encode_whole(text, add_special_tokens)
        with self._lock:
            self.stats.audits += 1
            if whole == ids:
                return ids
            self.stats.disagreements += 1
            self.active = False
            self._cache.clear()
            self.stats.cached_tokens = 0
        at = next((i for i, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b), None)
        log.warning(
            "chunked ids differ from whole ids at token %s (%d vs %d tokens): prompts are "
            "encoded whole from now on",
            at if at is not None else min(len(ids), len(whole)), len(ids), len(whole),
        )  # fmt: skip
        return whole


def _special_ids(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after a text's own ids (a BOS, an
    EOS), or None when it does something else."""
    sample = "a b"
    plain = tokenizer.encode(sample, add_special_tokens=False).ids
    full = tokenizer.encode(sample, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None


def probe_texts(tokenizer: Tokenizer) -> list[str]:
    """Texts that exercise every kind of cut: the vocabulary's own pieces, added tokens
    (with and without spaces around them), digits, punctuation, runs of whitespace and
    newlines, non-ASCII letters."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=False)
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    fixed = ["12 345", "x's y", "a  b", "a\tb", "a\nb c", "é ü", "中文 字", "a, b. c!", "(a b)"]
    texts = []
    for seed in range(PROBE_SEEDS):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab_size) for _ in range(200)]
        pieces: list[str] = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        pieces += fixed + added + [f"a {token} b" for token in added]
        rng.shuffle(pieces)
        texts.append(_join(pieces, rng))
    return texts


def _join(pieces: Sequence[str], rng: random.Random) -> str:
    """Pieces joined by a space mostly, sometimes by nothing, a newline or two spaces."""
    separators = [" "] * 6 + ["", "\n", "  "]
    return "".join(piece + rng.choice(separators) for piece in pieces)
