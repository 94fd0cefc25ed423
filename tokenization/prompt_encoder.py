"""The router's prompt encoder: HF ``tokenizers``' ids, computed faster two ways.

- **tiktoken** (``tokenization.fast_bpe``): for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen 2,
  the tiny model) the same ids, several times faster than HF (bench.router_overhead).
- **Chunks remembered**: multi-turn chats and shared system prompts send the same long text
  prefix again and again, and a tokenizer encodes it from scratch every time (the CPU of a
  whole long conversation, per turn; bench.router_overhead ``--trace conversation``). Cut at
  a space between two alphanumeric characters, a text's tokens are its chunks' tokens end to
  end for the tokenizers vLLM serves: byte-level BPE (GPT-2, Llama 3, Qwen), Metaspace
  (SentencePiece BPE or unigram) and WordPiece all start a pre-token at such a space and
  never look across it. Where a cut falls depends only on the text up to one character past
  it, so two prompts sharing a prefix share every chunk up to their last cut inside it;
  those chunks' ids come from an LRU cache, and only the rest is encoded.

Exactness is checked, not assumed: ``PromptEncoder.create`` compares both ways with HF's
whole ids on probe texts built from the tokenizer's own vocabulary and added tokens, and
uses neither where they differ (a normalizer that prepends or strips, as Llama 2's legacy
``tokenizer.json`` does, rules out chunks). Then every ``AUDIT_EVERY``-th encode is compared
with HF's whole encode in a background thread (off the request's path); a difference turns
both ways off for good (every prompt is then encoded whole by HF).
"""

from __future__ import annotations

import logging
import random
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tokenizers import Tokenizer

from .fast_bpe import FastBPE

log = logging.getLogger("tokenization")

CHUNK_CACHE_TOKENS = 2_000_000  # ids kept by default: tens of MB with their chunks' text
CHUNK_CHARS = 1024  # a chunk ends at the first cut this many characters after its start
AUDIT_EVERY = 64  # one encode in this many is checked against HF's whole encode
PROBE_CHUNK_CHARS = 1  # the probes cut at every possible place
PROBE_SEEDS = 4


def encode_whole(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # the batch form that skips character offsets: the same ids, in less time
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
class EncoderStats:
    """What the encoder did since it started (read by the router's metrics)."""

    reused_tokens: int = 0  # ids that came from the chunk cache
    encoded_tokens: int = 0  # ids computed for chunked texts
    audits: int = 0
    disagreements: int = 0
    cached_tokens: int = 0  # ids the chunk cache holds now


class PromptEncoder:
    """A tokenizer's ``encode`` for the router's prompts: through tiktoken where that is
    exact, long texts in chunks whose ids are reused, audited against HF.

    Thread-safe: the router encodes long prompts in worker threads.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_ids: tuple[list[int], list[int]],
        fast: FastBPE | None,
        max_cached_tokens: int,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self._before, self._after = special_ids  # what add_special_tokens puts around a text
        self.fast = fast  # None: HF encodes
        self.chunking = max_cached_tokens > 0
        self._max_cached_tokens = max_cached_tokens
        self._chunk_chars = chunk_chars
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._calls = 0
        self._auditor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-audit")
        self._audit: Future[None] | None = None
        self.active = True
        self.stats = EncoderStats()

    @classmethod
    def create(cls, tokenizer: Tokenizer, max_cached_tokens: int) -> PromptEncoder | None:
        """An encoder for ``tokenizer`` (chunks kept: ``max_cached_tokens`` ids, 0 for none),
        or None when neither way can give HF's exact ids (logged with the reason)."""
        if tokenizer.truncation or tokenizer.padding:
            log.info("prompts are encoded whole: the tokenizer truncates or pads")
            return None
        special_ids = _special_ids(tokenizer)
        if special_ids is None:
            log.info("prompts are encoded whole: special tokens are not only around the text")
            return None
        probes = probe_texts(tokenizer)
        fast = FastBPE.create(tokenizer, probes)
        encoder = cls(tokenizer, special_ids, fast, max_cached_tokens)
        if encoder.chunking and not encoder._chunks_agree(probes):
            log.info("long prompts are not cut into chunks: this tokenizer looks across spaces")
            encoder.chunking = False
        if not encoder.chunking and fast is None:
            return None
        encoder.clear()
        return encoder

    def _chunks_agree(self, probes: list[str]) -> bool:
        return all(
            self.encode_chunks(text, specials, PROBE_CHUNK_CHARS)
            == self.encode_whole(text, specials)
            for text in probes
            for specials in (True, False)
        )

    def encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return encode_whole(self._tokenizer, text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``, as ``encode_whole`` gives them."""
        if not self.active:
            return self.encode_whole(text, add_special_tokens)
        if self.chunking and len(text) >= 2 * self._chunk_chars:
            ids = self.encode_chunks(text, add_special_tokens, self._chunk_chars)
        elif self.fast is not None:
            ids = self._around(self.fast.encode(text), add_special_tokens)
        else:
            return self.encode_whole(text, add_special_tokens)
        with self._lock:
            self._calls += 1
            if self._calls % AUDIT_EVERY == 1 and self._audit is None:  # the first, then 1/N
                # a copy: the caller owns ``ids`` and may change it before the audit runs
                self._audit = self._auditor.submit(self._check, text, add_special_tokens, list(ids))
        return ids

    def _around(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        return self._before + ids + self._after if add_special_tokens else ids

    def _plain(self, texts: list[str]) -> list[list[int]]:
        if self.fast is not None:
            return [self.fast.encode(text) for text in texts]
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_chunks(self, text: str, add_special_tokens: bool, chunk_chars: int) -> list[int]:
        cuts = cut_points(text, chunk_chars)
        chunks = [text[start:end] for start, end in zip(cuts, cuts[1:], strict=False)]
        with self._lock:
            found = [self._cache.get(chunk) for chunk in chunks]
            for chunk, chunk_ids in zip(chunks, found, strict=True):
                if chunk_ids is not None:
                    self._cache.move_to_end(chunk)
        missing = list(dict.fromkeys(c for c, i in zip(chunks, found, strict=True) if i is None))
        encoded = {
            chunk: array("I", ids) for chunk, ids in zip(missing, self._plain(missing), strict=True)
        }
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
            self.stats = EncoderStats()

    def settle(self) -> None:
        """Waits for the audit in flight, if any (tests, shutdown)."""
        audit = self._audit
        if audit is not None:
            audit.result()

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

    def _check(self, text: str, add_special_tokens: bool, ids: list[int]) -> None:
        """The audit, in the auditor's thread: HF's whole ids against the ones given."""
        try:
            whole = self.encode_whole(text, add_special_tokens)
        finally:
            with self._lock:
                self._audit = None
        with self._lock:
            self.stats.audits += 1
            if whole == ids:
                return
            self.stats.disagreements += 1
            self.active = False
            self._cache.clear()
            self.stats.cached_tokens = 0
        at = next((i for i, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b), None)
        log.warning(
            "the router's ids differ from HF's whole ids at token %s (%d vs %d tokens): "
            "prompts are encoded whole by HF from now on",
            at if at is not None else min(len(ids), len(whole)), len(ids), len(whole),
        )  # fmt: skip


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
