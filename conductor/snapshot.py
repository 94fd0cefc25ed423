"""A portable snapshot of the index, so that a restart loses nothing the replays cannot give
back: registrations, each stream's last applied batch, and every owner's blocks per tier
(the format: docs/wire.md, "Snapshot").

Written atomically (temporary file, fsync, rename, fsync of the directory; the file it
replaces is kept as ``<path>.previous``), every ``snapshot_interval_s`` and at shutdown, and
served by ``GET /snapshot`` so that a peer can take it. While one is built no batch is
applied (``ServiceManager.ingest_paused``: the blocks and the sequence numbers agree), but
queries run: it is built one record at a time, yielding to the event loop between records.

At start the newest valid snapshot among the file, its previous one and each peer's is
restored before any batch is applied, and each stream's catch-up replays from the batch
after the snapshot's (``conductor.subscriber``); a snapshot that is unreadable, truncated
or corrupt is refused with a warning saying why, never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import os
import struct
import sys
import time
from array import array
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import aiohttp
import msgpack
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from . import __version__
from .config import Registration, one_line
from .hashing import PrefixHash
from .index import TIERS, ContextKey, PrefixCacheTable, _Slot
from .manager import ServiceManager
from .persistence import write_atomically
from .wire.events import EngineHash, Tier

log = logging.getLogger(__name__)

MAGIC = b"\x89CNDSNP\n"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">8sHdH")  # magic, format version, created (Unix time), producer length
DIGEST_BYTES = 32  # SHA-256 of everything before it
HASHES_PER_RECORD = 16_384  # block pairs per "blocks" record: about 2 ms to build
# physical copies of one block beyond the first that a snapshot may restore (an engine makes
# one per request computing the block at once): a larger count is malformed
MAX_COPIES = 65_536
PAUSE_TIMEOUT_S = 5.0  # batches being applied when a snapshot begins finish within this
SHUTDOWN_WRITE_S = 10.0  # the snapshot written at shutdown, at most
PREVIOUS_SUFFIX = ".previous"
T = TypeVar("T")


class SnapshotError(Exception):
    """A snapshot that cannot be used; the message says which and why, in one line."""


@dataclass(slots=True)
class OwnerBlocks:
    """One owner's blocks in a context: per tier, engine hashes with their prefix hashes,
    and the engine hashes held more than once (with the copies beyond the first)."""

    instance_id: str
    dp_rank: int
    streams: tuple[str, ...]
    blocks: dict[Tier, tuple[list[int], list[int]]] = field(default_factory=dict)
    copies: dict[Tier, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    created: float
    producer: str
    source: str  # the file or peer it was read from, for the log
    registrations: list[Registration]
    sequences: dict[str, int]
    contexts: list[tuple[ContextKey, list[OwnerBlocks]]]

    def resume_after(self, registration: Registration) -> int | None:
        """Where the stream resumes: its snapshot sequence, when the snapshot has this very
        registration (another one's blocks and sequence numbers are not its own)."""
        for known in self.registrations:
            if known == registration:
                return self.sequences.get(registration.key)
        return None

    def block_count(self) -> int:
        owners = (owner for _, of_context in self.contexts for owner in of_context)
        return sum(len(engines) for owner in owners for engines, _ in owner.blocks.values())


# -- writing ------------------------------------------------------------------------------
def _u64_bytes(values: Sequence[int]) -> bytes:
    """Hashes as little-endian unsigned 64-bit integers, whatever the host's byte order."""
    packed = array("Q", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _u64_list(raw: bytes) -> list[int]:
    if len(raw) % 8:
        raise ValueError("a hash array's length is not a multiple of 8 bytes")
    values = array("Q")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _owner_records(slot: _Slot) -> Iterator[bytes]:
    """An owner and its blocks, one record per ``HASHES_PER_RECORD`` blocks."""
    streams = sorted(slot.streams)
    yield msgpack.packb(["owner", slot.instance_id, slot.dp_rank, streams])
    for tier in TIERS:
        holdings = slot.holdings[tier]
        pairs = iter(holdings.by_engine_hash.items())
        while chunk := list(itertools.islice(pairs, HASHES_PER_RECORD)):
            engine = _u64_bytes([engine_hash for engine_hash, _ in chunk])
            prefix = _u64_bytes([prefix_hash for _, prefix_hash in chunk])
            yield msgpack.packb(["blocks", int(tier), engine, prefix])
        if holdings.copies:
            copies = list(holdings.copies.items())
            engine = _u64_bytes([engine_hash for engine_hash, _ in copies])
            yield msgpack.packb(["copies", int(tier), engine, [count for _, count in copies]])


def _records(
    table: PrefixCacheTable, registrations: list[Registration], sequences: dict[str, int]
) -> Iterator[bytes]:
    """The body, one record per step (its format: docs/wire.md). A kv_store pool comes
    after the engine slots of its context, which make it when restored."""
    meta = {
        "registrations": [r.model_dump(mode="json") for r in registrations],
        "sequences": sequences,
    }
    yield msgpack.packb(["meta", meta])
    for key in list(table.contexts):
        context = table.contexts.get(key)
        if context is None:  # unregistered meanwhile
            continue
        profile = context.profile.wire_view() if context.profile is not None else None
        yield msgpack.packb(
            ["context", key.tenant_id, key.model_name, key.lora_name, key.block_size, profile]
        )
        for slot in sorted(context.slots.values(), key=lambda s: bool(s.kv_store)):
            yield from _owner_records(slot)
    yield msgpack.packb(["end"])


class SnapshotMetrics:
    def __init__(self, manager: ServiceManager) -> None:
        registry = manager.metrics.registry
        self.bytes = Gauge(
            "conductor_snapshot_bytes", "Size of the last snapshot built", registry=registry
        )
        self.blocks = Gauge(
            "conductor_snapshot_blocks",
            "Blocks indexed when the last snapshot was built, each once however many owners "
            "hold it",
            registry=registry,
        )
        self.build_seconds = Gauge(
            "conductor_snapshot_build_seconds",
            "How long the last snapshot took to build (ingest paused meanwhile)",
            registry=registry,
        )
        self.longest_step_seconds = Gauge(
            "conductor_snapshot_longest_step_seconds",
            "The longest the last snapshot held the event loop in one step",
            registry=registry,
        )
        self.written = Gauge(
            "conductor_snapshot_written_timestamp_seconds",
            "When the snapshot file was last written (Unix time)",
            registry=registry,
        )
        self.failures = Counter(
            "conductor_snapshot_failures",
            "Snapshots not built or not written",
            registry=registry,
        )
        self.restored_blocks = Gauge(
            "conductor_snapshot_restored_blocks",
            "Blocks restored from a snapshot at start, once per owner holding them",
            registry=registry,
        )


class Snapshots:
    """Builds, writes, serves and finds snapshots of one conductor's index."""

    def __init__(
        self,
        manager: ServiceManager,
        path: Path | None = None,
        interval_s: float = 60.0,
        peers: Sequence[str] = (),
        peer_timeout_s: float = 10.0,
        auth_token: str = "",
    ) -> None:
        self.manager = manager
        self.path = path
        self.interval_s = interval_s
        self.peers = list(peers)
        self.peer_timeout_s = peer_timeout_s
        self.auth_token = auth_token
        self.metrics = SnapshotMetrics(manager)
        self._lock = asyncio.Lock()  # one build at a time
        self._periodic: asyncio.Task[None] | None = None

    async def build(self) -> bytes:
        """The index as a snapshot, built in steps while no batch is applied."""
        async with self._lock, self.manager.ingest_paused(PAUSE_TIMEOUT_S):
            began = time.perf_counter()
            created = time.time()
            producer = f"conductor {__version__}".encode()
            parts = [_HEAD.pack(MAGIC, FORMAT_VERSION, created, len(producer)), producer]
            registrations = sorted(self.manager.registrations.values(), key=lambda r: r.key)
            records = _records(self.manager.table, registrations, self.manager.applied_sequences())
            digest = hashlib.sha256(b"".join(parts))
            longest, step = 0.0, time.perf_counter()
            for record in records:  # one record a step: queries run in between
                parts.append(record)
                digest.update(record)
                longest = max(longest, time.perf_counter() - step)
                await asyncio.sleep(0)
                step = time.perf_counter()
            blocks = self.manager.table.block_count()
        data = b"".join((*parts, digest.digest()))
        self.metrics.build_seconds.set(time.perf_counter() - began)
        self.metrics.longest_step_seconds.set(longest)
        self.metrics.bytes.set(len(data))
        self.metrics.blocks.set(blocks)
        return data

    async def write(self) -> bool:
        """Build and write the snapshot file; a failure is logged and counted."""
        if self.path is None:
            return False
        try:
            data = await self.build()
            await asyncio.to_thread(_write_atomically, self.path, data)
        except (OSError, TimeoutError, RuntimeError) as error:
            self.metrics.failures.inc()
            log.error("snapshot %s not written: %s", self.path, _reason(error))
            return False
        self.metrics.written.set(time.time())
        log.info("snapshot written path=%s bytes=%d", self.path, len(data))
        return True

    def start(self) -> None:
        """Write the file every ``interval_s`` (nothing without a path)."""
        if self.path is not None and self._periodic is None:
            self._periodic = asyncio.create_task(self._every_interval(), name="snapshots")

    async def stop(self) -> None:
        """Stop the periodic writes and write once more (within ``SHUTDOWN_WRITE_S``)."""
        if self._periodic is None:
            return
        self._periodic.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._periodic
        self._periodic = None
        try:
            async with asyncio.timeout(SHUTDOWN_WRITE_S):
                await self.write()
        except TimeoutError:
            self.metrics.failures.inc()
            log.error("snapshot %s not written at shutdown within %gs", self.path, SHUTDOWN_WRITE_S)

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.write()

    # -- reading --------------------------------------------------------------------------
    async def newest(self) -> Snapshot | None:
        """The newest valid snapshot among the file, its previous one and the peers'; what
        is missing, unreachable or invalid is logged and skipped.

        Every source is read at once (a peer that hangs costs ``peer_timeout_s``, not that
        on top of the others), and only the newest by its header is decoded: the next one
        only when it is invalid, so a restart holds one decoded index, not one per source.
        """
        sources: list[tuple[str, Awaitable[bytes]]] = []
        if self.path is not None:
            for path in (self.path, _previous(self.path)):
                if path.exists():
                    sources.append((str(path), asyncio.to_thread(path.read_bytes)))
        urls = [f"{peer.rstrip('/')}/snapshot" for peer in self.peers]
        sources += [(url, self._from_peer(url)) for url in urls]
        read = await asyncio.gather(*(_skip_invalid(data, name) for name, data in sources))
        candidates = sorted(
            ((created, name, data) for (name, _), data in zip(sources, read, strict=True)
             if data is not None and (created := _created(data, name)) is not None),
            key=lambda candidate: candidate[0],
            reverse=True,
        )  # fmt: skip
        for _, name, data in candidates:
            snapshot = await _skip_invalid(asyncio.to_thread(parse, data, name), name)
            if snapshot is not None:
                log.info(
                    "snapshot chosen source=%s created=%.3f blocks=%d (of %d sources)",
                    snapshot.source,
                    snapshot.created,
                    snapshot.block_count(),
                    len(sources),
                )
                return snapshot
        return None

    async def _from_peer(self, url: str) -> bytes:
        headers = {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}
        timeout = aiohttp.ClientTimeout(total=self.peer_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, headers=headers) as response,
            ):
                if response.status != 200:
                    raise SnapshotError(f"{url} answered HTTP {response.status}")
                return await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise SnapshotError(f"{url} unreachable: {_reason(error)}") from None


async def _skip_invalid(reading: Awaitable[T], source: str) -> T | None:
    try:
        return await reading
    except SnapshotError as error:
        log.warning("snapshot skipped source=%s: %s", source, error)
    except OSError as error:
        log.warning("snapshot skipped source=%s: %s", source, _reason(error))
    return None


def _created(data: bytes, source: str) -> float | None:
    """When the snapshot in ``data`` was made, from its header alone (None, logged, when
    the header is not a snapshot's this conductor reads)."""
    try:
        return _header(data)
    except SnapshotError as error:
        log.warning("snapshot skipped source=%s: %s", source, error)
        return None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _previous(path: Path) -> Path:
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def _keep_previous(path: Path) -> None:
    """The current file, kept as ``<path>.previous`` through a hard link: ``path`` is then
    replaced in one step, and is never missing."""
    if not path.exists():
        return
    linked = path.with_name(f".{path.name}{PREVIOUS_SUFFIX}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(linked)
    os.link(path, linked)
    os.replace(linked, _previous(path))


def _write_atomically(path: Path, data: bytes) -> None:
    """The new file complete on disk before it replaces the old one, which is kept as
    ``<path>.previous``: a crash at any point leaves a complete snapshot behind."""
    write_atomically(path, data, before_replace=_keep_previous)


def read_file(path: Path) -> Snapshot:
    return parse(path.read_bytes(), str(path))


def _header(data: bytes) -> float:
    """The creation time in a snapshot's header, once the header is checked."""
    if len(data) < _HEAD.size + DIGEST_BYTES:
        raise SnapshotError(f"truncated: {len(data)} bytes is shorter than any snapshot")
    magic, version, created, _ = cast("tuple[bytes, int, float, int]", _HEAD.unpack_from(data))
    if magic != MAGIC:
        raise SnapshotError("not a conductor snapshot (wrong magic bytes)")
    if version != FORMAT_VERSION:
        raise SnapshotError(f"format version {version}; this conductor reads {FORMAT_VERSION}")
    if not math.isfinite(created):  # the newest snapshot is chosen by it
        raise SnapshotError(f"malformed content: creation time {created}")
    return created


def parse(data: bytes, source: str) -> Snapshot:
    """A snapshot's bytes checked and read; SnapshotError says what is wrong with them."""
    created = _header(data)
    if hashlib.sha256(data[:-DIGEST_BYTES]).digest() != data[-DIGEST_BYTES:]:
        raise SnapshotError(
            f"checksum mismatch over {len(data)} bytes: the snapshot is truncated or corrupt"
        )
    body = _HEAD.size + _HEAD.unpack_from(data)[3]
    try:
        producer = data[_HEAD.size : body].decode()
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data))
        unpacker.feed(data[body:-DIGEST_BYTES])
        snapshot = Snapshot(created, producer, source, [], {}, [])
        _read_records(unpacker, snapshot)
    except (ValueError, TypeError, LookupError, AttributeError, msgpack.UnpackException) as error:
        message = one_line(error) if isinstance(error, ValidationError) else str(error)
        raise SnapshotError(f"malformed content: {message}") from None
    return snapshot


def _read_records(records: Iterator[Any], snapshot: Snapshot) -> None:
    match next(records, None):
        case ["meta", dict(meta)]:
            pass
        case first:
            raise ValueError(f"the first record is {str(first)[:80]}, not the meta record")
    snapshot.registrations = [Registration.model_validate(r) for r in meta["registrations"]]
    snapshot.sequences = {str(key): int(seq) for key, seq in meta["sequences"].items()}
    if not all(0 <= seq < 2**63 for seq in snapshot.sequences.values()):
        raise ValueError("a sequence number is out of range")
    owners: list[OwnerBlocks] = []
    owner: OwnerBlocks | None = None
    for record in records:
        match record:
            case ["context", str(tenant), str(model), str(lora), int(block_size), _]:
                owners, owner = [], None
                snapshot.contexts.append((ContextKey(tenant, model, lora, block_size), owners))
            case ["owner", str(instance_id), int(dp_rank), list(streams)] if snapshot.contexts:
                owner = OwnerBlocks(instance_id, dp_rank, tuple(str(s) for s in streams))
                owners.append(owner)
            case ["blocks", int(tier), bytes(engine), bytes(prefix)] if owner is not None:
                engines, prefixes = _u64_list(engine), _u64_list(prefix)
                if len(engines) != len(prefixes):
                    raise ValueError("a blocks record's hash arrays differ in length")
                held = owner.blocks.setdefault(Tier(tier), ([], []))
                held[0].extend(engines)
                held[1].extend(prefixes)
            case ["copies", int(tier), bytes(engine), list(counts)] if owner is not None:
                if not all(type(count) is int and 0 < count <= MAX_COPIES for count in counts):
                    raise ValueError(f"a copy count is not an int in 1..{MAX_COPIES}")
                copies = zip(_u64_list(engine), counts, strict=True)
                owner.copies.setdefault(Tier(tier), []).extend(copies)
            case ["end"]:
                return
            case _:
                raise ValueError(f"unexpected record {str(record)[:80]}")
    raise ValueError("no end record")


# -- restoring ----------------------------------------------------------------------------
def restore_blocks(table: PrefixCacheTable, snapshot: Snapshot, resumed: set[str]) -> int:
    """Put the snapshot's blocks back for the owners of streams that resume from it (a
    stream read from its publisher's start would index them twice); returns how many."""
    restored = 0
    for context_key, owners in snapshot.contexts:
        for owner in owners:
            streams = [key for key in owner.streams if key in resumed]
            slot_key = (owner.instance_id, owner.dp_rank)
            target = table.restored_slot(context_key, slot_key, streams) if streams else None
            if target is None:
                continue
            context, slot = target
            # a pool holds the CPU blocks saved to its store, an engine any tier's
            tiers = (Tier.CPU,) if slot.kv_store else TIERS
            for tier, (engines, prefixes) in owner.blocks.items():
                if tier in tiers:
                    restored += context.hold(
                        slot,
                        tier,
                        cast(list[EngineHash], engines),
                        cast(list[PrefixHash], prefixes),
                    )
            for tier, copies in owner.copies.items():
                mapping = slot.holdings[tier].by_engine_hash
                for engine_hash, count in copies:
                    prefix_hash = mapping.get(EngineHash(engine_hash))
                    if prefix_hash is not None:  # one more hold of a held block: one more copy
                        context.hold(
                            slot, tier, [EngineHash(engine_hash)] * count, [prefix_hash] * count
                        )
    return restored
