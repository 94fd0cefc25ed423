"""Byte-level BPE through tiktoken: the ids HF ``tokenizers`` gives, several times faster.

HF ``tokenizers`` spends much of its time per token on bookkeeping the router never reads:
character alignments, offsets, an ``Encoding`` object per text. tiktoken's core runs the
same algorithm, a regex split then byte-pair merges by rank, without it
(bench.router_overhead times both in the router). The two give the same ids when
the tokenizer is what GPT-2, Llama 3, Qwen 2 and the tiny test model are:

- a BPE model without dropout, unknown token, subword prefix or suffix, byte fallback;
  every single byte a token, and its merges in the order of their results' ids (tiktoken
  merges the adjacent pair whose result has the lowest id, HF the pair listed first);
- byte-level pre-tokenization by one regex: ``ByteLevel`` with its GPT-2 regex, or a
  ``Split`` regex ("isolated") before a ``ByteLevel`` without one (Llama 3, Qwen 2);
- no normalizer, or NFC (Qwen 2), applied here to each text between added tokens as HF does;
- added tokens matched literally (no ``lstrip``, ``rstrip`` or ``single_word``; with NFC
  none ``normalized``), the longest one at a place first;
- no truncation or padding.

Exactness is checked, not assumed: ``FastBPE.create`` encodes every vocabulary entry's text
and the probe texts both ways and refuses the tokenizer on any difference (logged with the
reason); ``PromptEncoder`` then audits its encodes against HF (``tokenization.prompt_encoder``).
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from collections.abc import Callable
from typing import Any

import tiktoken
from tokenizers import Tokenizer

log = logging.getLogger("tokenization")

# HF ByteLevel's own regex (use_regex=True), GPT-2's
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_decoder() -> dict[str, int]:
    """ByteLevel's alphabet: the printable character standing for each byte (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {char: byte for byte, char in chars.items()}


class Ineligible(Exception):
    """Why tiktoken cannot give this tokenizer's ids."""


def _pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    def byte_level(step: dict[str, Any], use_regex: bool) -> bool:
        return (
            step.get("type") == "ByteLevel"
            and step.get("use_regex", True) is use_regex
            and not step.get("add_prefix_space", False)
        )

    if pre_tokenizer is not None and byte_level(pre_tokenizer, True):
        return GPT2_PATTERN
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    if len(steps) == 2 and steps[0].get("type") == "Split" and byte_level(steps[1], False):
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex")
        if regex is not None and split.get("behavior") == "Isolated" and not split.get("invert"):
            return str(regex)
    raise Ineligible(f"the pre-tokenizer is not a byte-level regex split: {pre_tokenizer}")


def _normalizer(normalizer: dict[str, Any] | None) -> Callable[[str], str] | None:
    if normalizer is None:
        return None
    if normalizer.get("type") == "NFC":
        return lambda text: unicodedata.normalize("NFC", text)
    raise Ineligible(f"the normalizer is not NFC: {normalizer.get('type')}")


def _ranks(model: dict[str, Any], added: set[int]) -> dict[bytes, int]:
    """The vocabulary as tiktoken's byte strings and ranks (their ids)."""
    for option in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise Ineligible(f"the BPE model sets {option}")
    if model.get("byte_fallback"):
        raise Ineligible("the BPE model falls back to bytes")
    to_byte = _byte_decoder()
    try:
        ranks = {
            bytes(to_byte[char] for char in token): rank
            for token, rank in model["vocab"].items()
            if rank not in added
        }
    except KeyError:
        raise Ineligible("a vocabulary entry is not in the byte-level alphabet") from None
    if any(bytes([byte]) not in ranks for byte in range(256)):
        raise Ineligible("a byte is not a token of its own")
    # a merge is ["a", "b"] or, in older files, "a b"
    merged = ("".join(pair) if isinstance(pair, list) else pair.replace(" ", "", 1)
              for pair in model["merges"])  # fmt: skip
    results = [model["vocab"].get(token) for token in merged]
    if None in results or any(x >= y for x, y in zip(results, results[1:], strict=False)):
        raise Ineligible("the merges are not in the order of their results' ids")
    return ranks


class FastBPE:
    """A byte-level BPE tokenizer's ``encode(text, add_special_tokens=False)`` through
    tiktoken. Thread-safe (tiktoken releases the GIL while it encodes)."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        added: dict[str, int],
        normalize: Callable[[str], str] | None,
    ) -> None:
        self._encoding = encoding
        self._added = added
        self._normalize = normalize
        # the longest added token at a place wins, as in HF's added vocabulary
        longest_first = sorted(added, key=len, reverse=True)
        self._split = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")").split if added else None
        )

    @classmethod
    def create(cls, tokenizer: Tokenizer, probes: list[str]) -> FastBPE | None:
        """The fast encoder for ``tokenizer``, or None (logged with the reason) when it
        cannot be exact or gives other ids than HF for a vocabulary entry or a probe."""
        try:
            fast = cls._build(tokenizer)
        except Ineligible as reason:
            log.info("prompts are encoded by HF tokenizers: %s", reason)
            return None
        ranks = range(tokenizer.get_vocab_size(with_added_tokens=True))
        texts = tokenizer.decode_batch([[rank] for rank in ranks], skip_special_tokens=False)
        texts += probes
        expected = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        for text, encoding in zip(texts, expected, strict=True):
            if fast.encode(text) != encoding.ids:
                log.info("prompts are encoded by HF tokenizers: tiktoken differs on %r", text)
                return None
        return fast

    @classmethod
    def _build(cls, tokenizer: Tokenizer) -> FastBPE:
        if tokenizer.truncation or tokenizer.padding:
            raise Ineligible("the tokenizer truncates or pads")
        spec = json.loads(tokenizer.to_str())
        if spec["model"].get("type") != "BPE":
            raise Ineligible(f"the model is {spec['model'].get('type')}, not BPE")
        normalize = _normalizer(spec.get("normalizer"))
        added: dict[str, int] = {}
        for token in spec.get("added_tokens", []):
            if token["lstrip"] or token["rstrip"] or token["single_word"]:
                raise Ineligible(f"added token {token['content']!r} strips or is a word")
            if normalize is not None and token["normalized"]:
                raise Ineligible(f"added token {token['content']!r} is matched normalized")
            added[token["content"]] = token["id"]
        encoding = tiktoken.Encoding(
            "router-fast-bpe",
            pat_str=_pattern(spec.get("pre_tokenizer")),
            mergeable_ranks=_ranks(spec["model"], set(added.values())),
            special_tokens={},
        )
        return cls(encoding, added, normalize)

    def encode(self, text: str) -> list[int]:
        """HF's ids for ``text`` without the ones ``add_special_tokens`` puts around it.
        ``text`` must be valid Unicode (``LocalTokenizer.encode`` refuses a lone surrogate,
        which HF refuses and tiktoken would replace)."""
        if self._split is None:
            return self._encode_plain(text)
        ids: list[int] = []
        for n, part in enumerate(self._split(text)):
            if n % 2:
                ids.append(self._added[part])
            elif part:
                ids += self._encode_plain(part)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if self._normalize is not None:
            text = self._normalize(text)
        return self._encoding.encode_ordinary(text)
