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

import hashlib
import pickle
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

STRATEGIES = ("vllm_v1",)
ALGORITHMS = ("sha256", "sha256_cbor")
PROJECTIONS = ("low64_be",)
RANDOM_SEED = "random"  # vLLM hashes the literal text when PYTHONHASHSEED=random
MAX_SEED = 2**32 - 1  # CPython's PYTHONHASHSEED range
PICKLE_PROTOCOL = 5  # what vLLM's sha256 pickles with (pickle.HIGHEST_PROTOCOL on 3.8+)
_CBOR_TEXT = 0x60  # CBOR major type 3 (text string), length in the low five bits
_CBOR_LENGTH_BYTES = {24: 1, 25: 2, 26: 4, 27: 8}  # additional info -> length bytes


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


def cbor_text(text: str) -> bytes:
    """``text`` as a CBOR text string (RFC 8949 §3.1, the shortest length form)."""
    data = text.encode("utf-8")
    size = len(data)
    if size < 24:
        return bytes([_CBOR_TEXT | size]) + data
    for info, width in _CBOR_LENGTH_BYTES.items():
        if size < 1 << (8 * width):
            return bytes([_CBOR_TEXT | info]) + size.to_bytes(width, "big") + data
    raise ValueError("text too long for CBOR")


def encode_seed(algorithm: str, seed: str) -> bytes:
    """The bytes vLLM's hash function digests for the seed text under ``algorithm``."""
    if algorithm == "sha256_cbor":
        return cbor_text(seed)
    return pickle.dumps(seed, protocol=PICKLE_PROTOCOL)


def root_digest(algorithm: str, seed: str) -> str:
    """vLLM's ``NONE_HASH`` for this algorithm and seed text, as lowercase hex."""
    return hashlib.sha256(encode_seed(algorithm, seed)).hexdigest()


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

    def describe(self) -> str:
        """One line for a log or an error: ``vllm_v1/sha256_cbor seed="0" low64_be``."""
        return (
            f'{self.strategy}/{self.algorithm} seed="{self.python_hash_seed}" '
            f"{self.index_projection}"
        )
