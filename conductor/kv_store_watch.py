"""Bounded staleness of the kv_store pools: a Mooncake store evicts without any event.

vLLM's MooncakeStoreConnector announces each block it saves (medium "cpu"); nothing
announces the store's evictions. So every ``interval`` each store some registration names
is asked for all its keys (``GET /get_all_keys`` on the master's admin server), and a pool
block announced before that request went out whose digest no key carries was evicted: it
leaves the index. A block announced while the answer is on its way may be missing from it
and is kept. Checks start at a fixed rate, so a block evicted at time t is gone from
``/query`` by t + interval + one check's duration, as long as checks take at most
``MAX_CHECK_SHARE`` of the interval; a bigger store is checked less often, by
t + 1/MAX_CHECK_SHARE × one check's duration (docs/kv-store.md has the measurements).

A check that fails (refused, timed out, not 200, a broken answer) means the master is down
or restarting, and a restarted master is empty: the store's pools are emptied at once and
its CPU events dropped until a check answers again. A master that restarted between two
checks answers with fewer keys, and the eviction rule clears what it lost.

Keys are the connector's, ``<model>@tp_rank:0@...@<digest hex>``; a block's engine hash is
the digest's low 64 bits (its last 16 hex digits). Keys without such a last field are
counted as unparsable and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp

from .config import DEFAULT_STORE_CHECK_SILENCE_S
from .failures import connect_failure
from .index import PrefixCacheTable
from .metrics import ConductorMetrics
from .states import StoreState
from .wire.events import EngineHash

log = logging.getLogger(__name__)

KEY_DIGEST = re.compile(rb"@([0-9a-fA-F]{16,128})\r?$", re.MULTILINE)
CHUNK_BYTES = 1 << 18  # parsed between two yields to the loop: ~2,300 keys, a few ms
MAX_CHECK_SHARE = 0.2  # of the conductor's time a store's checks may take at most


# a dead master refuses at once; a hung one is down after 10 s of silence; a million keys
# stream for seconds (bench/kv_store_check_bench.py), so only the whole answer gets 60 s
def check_timeout(silence_s: float) -> aiohttp.ClientTimeout:
    """A check's bounds: the connection within 2 s, ``silence_s`` of silence at most, the
    whole key list within 60 s."""
    return aiohttp.ClientTimeout(total=60, sock_connect=min(2, silence_s), sock_read=silence_s)


class CheckFailed(Exception):
    """The master did not give its key list; ``outcome`` labels the check metric."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome


@dataclass(slots=True)
class StoreKeys:
    """The answer of ``/get_all_keys``, parsed chunk by chunk (it can be 100 MB)."""

    digests: set[EngineHash] = field(default_factory=set)  # low 64 bits of the digests
    keys: int = 0
    unparsable: int = 0
    _rest: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        self._parse(data[:cut])

    def finish(self) -> StoreKeys:
        if self._rest:
            self._parse(self._rest + b"\n")
            self._rest = b""
        return self

    def _parse(self, lines: bytes) -> None:
        found = KEY_DIGEST.findall(lines)
        count = lines.count(b"\n")
        self.keys += count
        self.unparsable += count - len(found)
        digests = (int(digest[-16:], 16) for digest in found)
        self.digests.update(cast("Iterator[EngineHash]", digests))  # no NewType call per key


async def fetch_keys(session: aiohttp.ClientSession, admin_url: str) -> StoreKeys:
    """Every key the master holds, within the session's timeout (``check_timeout``); raises
    CheckFailed when it cannot say."""
    keys, timeout = StoreKeys(), session.timeout
    try:
        async with session.get(f"{admin_url}/get_all_keys") as response:
            if response.status != 200:
                raise CheckFailed("status", f"GET /get_all_keys answered {response.status}")
            async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                keys.feed(chunk)
                await asyncio.sleep(0)  # a buffered answer must not hold queries back
    except TimeoutError:
        raise CheckFailed(
            "timeout",
            f"no connection within {timeout.sock_connect:g} s, {timeout.sock_read:g} s"
            f" of silence or no whole answer within {timeout.total:g} s",
        ) from None
    except aiohttp.ClientConnectorError as error:
        raise CheckFailed("unreachable", connect_failure(error)) from None
    except aiohttp.ClientError as error:
        raise CheckFailed("error", f"{type(error).__name__}: {error}") from None
    return keys.finish()


async def check_store(
    table: PrefixCacheTable,
    session: aiohttp.ClientSession,
    kv_store: str,
    admin_url: str,
) -> tuple[StoreKeys, int]:
    """One check: fetch the key list, drop the pool blocks it shows evicted. Returns the
    keys and how many blocks were dropped; raises CheckFailed."""
    table.begin_store_check(kv_store)
    try:
        keys = await fetch_keys(session, admin_url)
        evicted = 0
        for dropped in table.reconcile_store(kv_store, keys.digests):
            evicted += dropped
            await asyncio.sleep(0)  # a million pool blocks must not hold queries back
        return keys, evicted
    finally:
        table.end_store_check(kv_store)


@dataclass(slots=True)
class _Store:
    admin_url: str
    state: StoreState = StoreState.UNCHECKED
    checked_at: float | None = None  # monotonic end of the last check
    task: asyncio.Task[None] | None = None
    told_unparsable: bool = False  # foreign keys are said once, then only counted


class StoreWatch:
    """One checking task per store some registration names; see the module docstring."""

    def __init__(
        self,
        table: PrefixCacheTable,
        metrics: ConductorMetrics,
        admin_url: Callable[[str], str],
        interval: float,
        silence_s: float = DEFAULT_STORE_CHECK_SILENCE_S,
    ) -> None:
        self._table = table
        self._metrics = metrics
        self._admin_url = admin_url
        self._interval = interval
        self._timeout = check_timeout(silence_s)
        self._stores: dict[str, _Store] = {}
        self._session: aiohttp.ClientSession | None = None

    def watch(self, kv_store: str) -> None:
        """Start checking the store (no-op when it is checked already)."""
        if kv_store in self._stores:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        store = self._stores[kv_store] = _Store(self._admin_url(kv_store))
        self._metrics.store_state.labels(kv_store).state(store.state)
        store.task = asyncio.create_task(self._run(kv_store, store), name=f"check:{kv_store}")
        log.info("kv_store=%s checked every %g s at %s", kv_store, self._interval, store.admin_url)

    async def forget(self, kv_store: str) -> None:
        """No registration names the store any more: stop checking it."""
        store = self._stores.pop(kv_store, None)
        if store is None:
            return
        if store.task is not None:
            store.task.cancel()
            await asyncio.gather(store.task, return_exceptions=True)
        self._metrics.forget_store(kv_store)

    async def close(self) -> None:
        for kv_store in list(self._stores):
            await self.forget(kv_store)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def view(self) -> dict[str, dict[str, Any]]:
        """Each store's state and how long ago its last check ended (``/health``)."""
        now = time.monotonic()
        return {
            kv_store: {
                "state": store.state,
                "checked_s_ago": None
                if store.checked_at is None
                else round(now - store.checked_at, 3),
            }
            for kv_store, store in self._stores.items()
        }

    async def _run(self, kv_store: str, store: _Store) -> None:
        """Checks start every interval, but a store too big to list that often is listed
        at most ``MAX_CHECK_SHARE`` of the time: a check of a million keys takes seconds of
        the conductor's CPU, and back-to-back checks starved ``/query`` of its loop."""
        next_start = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                await self._check(kv_store, store)
            except Exception:  # a bug must cost one check, never the store's next ones
                log.exception("kv_store=%s check could not be completed", kv_store)
            ended = time.monotonic()
            rest = (ended - started) * (1 / MAX_CHECK_SHARE - 1)
            next_start = max(next_start + self._interval, ended + rest)
            await asyncio.sleep(next_start - time.monotonic())

    async def _check(self, kv_store: str, store: _Store) -> None:
        assert self._session is not None
        started = time.monotonic()
        try:
            keys, evicted = await check_store(self._table, self._session, kv_store, store.admin_url)
        except CheckFailed as failure:
            outcome = failure.outcome
            self._down(kv_store, store, str(failure))
        else:
            outcome = "ok"
            self._up(kv_store, store, keys, evicted)
        store.checked_at = time.monotonic()
        self._metrics.store_checks.labels(kv_store, outcome).inc()
        self._metrics.store_check_seconds.labels(kv_store).observe(store.checked_at - started)

    def _up(self, kv_store: str, store: _Store, keys: StoreKeys, evicted: int) -> None:
        self._metrics.store_blocks_dropped.labels(kv_store, "evicted").inc(evicted)
        self._metrics.store_keys.labels(kv_store, "block").set(keys.keys - keys.unparsable)
        self._metrics.store_keys.labels(kv_store, "unparsable").set(keys.unparsable)
        if evicted:
            log.debug("kv_store=%s keys=%d evicted_blocks_dropped=%d", kv_store, keys.keys, evicted)
        if keys.unparsable and not store.told_unparsable:
            store.told_unparsable = True
            log.warning(
                "kv_store=%s: %d of its %d keys are no MooncakeStoreConnector block keys "
                "(model@...@digest hex); they are ignored",
                kv_store,
                keys.unparsable,
                keys.keys,
            )
        if store.state is StoreState.DOWN:
            log.warning("kv_store=%s answers again: its CPU events are indexed", kv_store)
        self._set_state(kv_store, store, StoreState.UP)

    def _down(self, kv_store: str, store: _Store, reason: str) -> None:
        dropped = self._table.store_down(kv_store)
        self._metrics.store_blocks_dropped.labels(kv_store, "store_down").inc(dropped)
        if store.state is not StoreState.DOWN:
            log.warning(
                "kv_store=%s down: %s at %s; %d blocks cleared, its CPU events are dropped "
                "until it answers again",
                kv_store,
                reason,
                store.admin_url,
                dropped,
            )
        self._set_state(kv_store, store, StoreState.DOWN)

    def _set_state(self, kv_store: str, store: _Store, state: StoreState) -> None:
        store.state = state
        self._metrics.store_state.labels(kv_store).state(state)
