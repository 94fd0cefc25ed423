"""How an engine hashes its blocks, as upstream Mooncake's C++ conductor has registrations
say it: a ``hash_profile`` of four text selectors, and the ``root_digest`` it implies.

``vllm_v1`` names vLLM's block-hash chain: its digest (``sha256`` over pickle protocol 5,
or ``sha256_cbor`` over canonical CBOR), the engine's ``PYTHONHASHSEED`` as text, and how a
32-byte digest becomes the 64-bit key in events (``low64_be``: its last eight bytes,
big-endian). vLLM roots every chain at ``hash(seed text)`` (its ``NONE_HASH``), so the root
depends on the seed's exact text: "0" and "00" are different profiles. The root is derived
here, never accepted from a client.

``sglang`` and ``sglang_bigram`` (upstream's later revision) name SGLang's chain, plain or
over bigrams (``conductor.sglang_hash``): algorithm ``sha256_raw``, projection
``first64_be`` (a digest's first eight bytes). SGLang has no seed: one given is accepted
and kept as upstream keeps it, ``"0"``, with an all-zero root.

Validation follows upstream's exactly (which values pass, which fail); the message names
what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from . import sglang_hash
from .vllm_hash import block_keys, none_hash

VLLM = "vllm_v1"
SGLANG, SGLANG_BIGRAM = "sglang", "sglang_bigram"
STRATEGIES = (VLLM, SGLANG, SGLANG_BIGRAM)
# per strategy kind: the algorithms and projections it allows
ALGORITHMS = {VLLM: ("sha256", "sha256_cbor"), SGLANG: ("sha256_raw",)}
PROJECTIONS = {VLLM: ("low64_be",), SGLANG: ("first64_be",)}
RANDOM_SEED = "random"  # vLLM hashes the literal text when PYTHONHASHSEED=random
MAX_SEED = 2**32 - 1  # CPython's PYTHONHASHSEED range
SGLANG_SEED = "0"  # upstream's stand-in: SGLang has no seed
SGLANG_ROOT = "0" * 64


def _kind(strategy: str) -> str:
    """A strategy's family: the SGLang chains share their selectors."""
    return SGLANG if strategy in (SGLANG, SGLANG_BIGRAM) else VLLM


def _one_of(allowed: tuple[str, ...], what: str, value: str) -> str:
    if value not in allowed:
        raise ValueError(f"unsupported {what} {value!r} (supported: {', '.join(allowed)})")
    return value


def _seed_text(value: str) -> str:
    """``random`` or ASCII decimal digits 0..2^32-1, leading zeros kept (no sign, space)."""
    if value == RANDOM_SEED:
        return value
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f'must be "{RANDOM_SEED}" or ASCII decimal text in 0..{MAX_SEED}')
    if int(value) > MAX_SEED:
        raise ValueError(f"must be in range 0..{MAX_SEED}")
    return value


Selector = Annotated[str, Field(min_length=1)]


def root_digest(algorithm: str, seed: str) -> str:
    """vLLM's ``NONE_HASH`` for this algorithm and seed text, as lowercase hex."""
    return none_hash(algorithm, seed).hex()


class HashProfile(BaseModel):
    """A registration's ``hash_profile``: exactly these four non-empty strings (the seed
    optional for SGLang)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    strategy: Selector
    algorithm: Selector
    python_hash_seed: Selector
    index_projection: Selector

    @model_validator(mode="before")
    @classmethod
    def _sglang_has_no_seed(cls, data: Any) -> Any:
        """SGLang's chains read no seed: absent or any text, it is kept as upstream's "0"."""
        if isinstance(data, dict) and data.get("strategy") in (SGLANG, SGLANG_BIGRAM):
            if isinstance(data.get("python_hash_seed", ""), str):
                return {**data, "python_hash_seed": SGLANG_SEED}
        return data

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, value: str) -> str:
        return _one_of(STRATEGIES, "hash strategy", value)

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, value: str, info: ValidationInfo) -> str:
        kind = _kind(info.data.get("strategy", VLLM))
        return _one_of(ALGORITHMS[kind], "hash algorithm", value)

    @field_validator("python_hash_seed")
    @classmethod
    def _seed(cls, value: str) -> str:
        return _seed_text(value)

    @field_validator("index_projection")
    @classmethod
    def _projection(cls, value: str, info: ValidationInfo) -> str:
        kind = _kind(info.data.get("strategy", VLLM))
        return _one_of(PROJECTIONS[kind], "index projection", value)

    @property
    def is_sglang(self) -> bool:
        return _kind(self.strategy) == SGLANG

    @property
    def root_digest(self) -> str:
        if self.is_sglang:
            return SGLANG_ROOT
        return root_digest(self.algorithm, self.python_hash_seed)

    def wire_view(self) -> dict[str, Any]:
        """The five keys upstream's ``/services`` and ``/global_view`` show."""
        return {
            "strategy": self.strategy,
            "algorithm": self.algorithm,
            "python_hash_seed": self.python_hash_seed,
            "root_digest": self.root_digest,
            "index_projection": self.index_projection,
        }

    def block_keys(
        self,
        token_ids: Sequence[int] | bytes,
        block_size: int,
        lora_name: str = "",
        cache_salt: str = "",
    ) -> Iterator[int]:
        """The keys the engine's events name a prompt's complete blocks by, lazily
        (``vllm_hash.block_keys``; ``sglang_hash.block_keys``, which, as upstream's, takes
        no LoRA name)."""
        if self.is_sglang:
            bigram = self.strategy == SGLANG_BIGRAM
            return sglang_hash.block_keys(token_ids, block_size, cache_salt, bigram)
        return block_keys(
            self.algorithm, self.python_hash_seed, token_ids, block_size, lora_name, cache_salt
        )

    def describe(self) -> str:
        """One line for a log or an error: ``vllm_v1/sha256_cbor seed="0" low64_be``."""
        return (
            f'{self.strategy}/{self.algorithm} seed="{self.python_hash_seed}" '
            f"{self.index_projection}"
        )
