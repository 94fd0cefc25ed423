"""How an engine hashes its blocks, as upstream Mooncake's C++ conductor has registrations
say it: a ``hash_profile`` of four text selectors, and the ``root_digest`` it implies.

A profile names vLLM's block-hash chain (``vllm_v1``), its digest (``sha256`` over pickle
protocol 5, or ``sha256_cbor`` over canonical CBOR), the engine's ``PYTHONHASHSEED`` as
text, and how a 32-byte digest becomes the 64-bit key in events (``low64_be``: its last
eight bytes, big-endian). vLLM roots every chain at ``hash(seed text)`` (its
``NONE_HASH``), so the root depends on the seed's exact text: "0" and "00" are different
profiles. The root is derived here, never accepted from a client.

Validation follows upstream's exactly (which values pass, which fail); the message names
what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .vllm_hash import block_keys, none_hash

STRATEGIES = ("vllm_v1",)
ALGORITHMS = ("sha256", "sha256_cbor")
PROJECTIONS = ("low64_be",)
RANDOM_SEED = "random"  # vLLM hashes the literal text when PYTHONHASHSEED=random
MAX_SEED = 2**32 - 1  # CPython's PYTHONHASHSEED range


def _one_of(allowed: tuple[str, ...], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"unsupported {what} {value!r} (supported: {', '.join(allowed)})")
        return value

    return AfterValidator(check)


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
    """A registration's ``hash_profile``: exactly these four non-empty strings."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    strategy: Annotated[Selector, _one_of(STRATEGIES, "hash strategy")]
    algorithm: Annotated[Selector, _one_of(ALGORITHMS, "hash algorithm")]
    python_hash_seed: Annotated[Selector, AfterValidator(_seed_text)]
    index_projection: Annotated[Selector, _one_of(PROJECTIONS, "index projection")]

    @property
    def root_digest(self) -> str:
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
        (``vllm_hash.block_keys``)."""
        return block_keys(
            self.algorithm, self.python_hash_seed, token_ids, block_size, lora_name, cache_salt
        )

    def describe(self) -> str:
        """One line for a log or an error: ``vllm_v1/sha256_cbor seed="0" low64_be``."""
        return (
            f'{self.strategy}/{self.algorithm} seed="{self.python_hash_seed}" '
            f"{self.index_projection}"
        )
