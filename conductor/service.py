"""The whole conductor service as one aiohttp app.

``create_app`` builds every part from the settings; one ``cleanup_ctx`` function starts
what runs behind the routes (the config file's and the state file's registrations, the
store checks they start, the loop-lag monitor) before the app serves, and stops all of it
when the app is cleaned up. ``mooncake-conductor`` runs the app on its guarded socket, and
tests run the very same app in-process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from .api import ApiOptions, HttpLimits, api_app
from .config import ConductorConfig, Registration, Settings
from .http_guard import ConnectionGuard
from .index import PrefixCacheTable
from .kv_store_watch import StoreWatch
from .manager import CapacityExceeded, RegistrationConflict, RegistrationFailed, ServiceManager
from .metrics import ConductorMetrics
from .persistence import StateFile
from .runtime import GcPauseMonitor, LoopLagMonitor
from .security import BearerAuth, EndpointAllowlist, EndpointRefused
from .snapshot import PAUSE_TIMEOUT_S, Snapshot, Snapshots, restore_blocks
from .stream_limits import StreamLimits

log = logging.getLogger("conductor")

MANAGER = web.AppKey("manager", ServiceManager)
# a snapshot's registration that cannot be made: skipped, the others go on
REFUSED_AT_START = (RegistrationConflict, RegistrationFailed, CapacityExceeded, EndpointRefused)
GUARD = web.AppKey("guard", ConnectionGuard)  # the serving socket's; in-process tests skip it


def state_path(settings: Settings, config_path: str) -> Path | None:
    """Persistence is on by default, beside the config file and per port (two conductors
    started from one directory do not share a file); an empty ``state_file`` turns it off."""
    if settings.state_file is not None:
        return Path(os.path.expanduser(settings.state_file)) if settings.state_file else None
    config_dir = Path(os.path.expanduser(config_path)).parent
    return config_dir / f"conductor_state.{settings.http_server_port}.json"


def index_manager(
    config: ConductorConfig, limits: StreamLimits, ingest_thread: bool = False
) -> ServiceManager:
    """The index and what feeds it: the streams' subscribers, the store checks, metrics.
    The service serves it over HTTP; a router with ``conductor.embedded`` asks it itself."""
    table = PrefixCacheTable()
    metrics = ConductorMetrics(table)
    stores = StoreWatch(
        table,
        metrics,
        config.store_admin_url,
        config.kv_store_check_interval_s,
        config.kv_store_check_silence_s,
    )
    return ServiceManager(table, metrics, stores, limits, ingest_thread)


def create_app(
    settings: Settings, limits: StreamLimits, config: ConductorConfig, state: Path | None
) -> web.Application:
    """The service, ready to run (``state``: the registrations file, None to keep none)."""
    manager = index_manager(config, limits, settings.ingest_thread)
    metrics = manager.metrics
    allowlist = _allowlist(settings, config.registrations())
    state_file = StateFile(state) if state is not None else None
    snapshots = Snapshots(
        manager,
        Path(os.path.expanduser(settings.snapshot_path)) if settings.snapshot_path else None,
        settings.snapshot_interval_s,
        settings.peers,
        settings.peer_timeout_s,
        settings.auth_token,
    )
    guard = ConnectionGuard(
        settings.header_timeout_s, settings.max_connections, metrics.registry, manager.loop_share
    )
    options = ApiOptions(
        limits=HttpLimits(
            settings.max_body_bytes,
            settings.max_query_tokens,
            settings.max_query_hashes,
            settings.body_timeout_s,
        ),
        auth=BearerAuth(settings.auth_token, settings.auth_all),
        allowlist=allowlist,
        state=state_file,
        guard=guard,
        snapshots=snapshots,
        replica_wait_s=settings.replica_wait_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        query_lane=settings.query_lane,
    )
    app = api_app(manager, options)
    app[MANAGER] = manager
    app[GUARD] = guard
    lag = LoopLagMonitor(metrics.registry, "conductor")
    gc_pauses = GcPauseMonitor(metrics.registry, "conductor")
    app.cleanup_ctx.append(
        _running(manager, lag, gc_pauses, config.registrations(), state_file, allowlist, snapshots)
    )
    return app


def _running(
    manager: ServiceManager,
    lag: LoopLagMonitor,
    gc_pauses: GcPauseMonitor,
    registrations: list[Registration],
    state: StateFile | None,
    allowlist: EndpointAllowlist,
    snapshots: Snapshots,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def running(_: web.Application) -> AsyncIterator[None]:
        """Registrations indexed (and a snapshot restored) before the first request;
        everything stopped after the last one, and a last snapshot written. A conflicting
        config file raises here, and the app does not start."""

        async def registering(recovery: Recovery) -> None:
            for registration in registrations:
                await recovery.register(registration)
            if state is not None:
                await restore(recovery, state, allowlist)
            if recovery.snapshot is not None:
                await adopt(recovery, recovery.snapshot, state, allowlist)

        try:
            await recover(manager, snapshots, registering)
            lag.start()
            gc_pauses.start()
            yield
        finally:
            await snapshots.stop()
            gc_pauses.stop()
            await lag.stop()
            await manager.close()

    return running


async def recover(
    manager: ServiceManager,
    snapshots: Snapshots,
    registering: Callable[[Recovery], Awaitable[None]],
) -> Snapshot | None:
    """A start from the newest snapshot (``Snapshots.newest``: the file, its previous one,
    the peers'), the conductor service's and a router's embedded index's alike: before any
    batch is applied, the registrations ``registering`` makes through the ``Recovery``
    (each resuming from the snapshot's sequence number when the snapshot has the very same
    registration) and the blocks of the streams that resume; then the periodic writes.
    Returns the snapshot restored (None: none was found)."""
    snapshot = await snapshots.newest()
    async with manager.ingest_paused(PAUSE_TIMEOUT_S):  # nothing applied yet
        recovery = Recovery(manager, snapshot)
        await registering(recovery)
        if snapshot is not None:
            recovery.restore_blocks(snapshots)
    snapshots.start()
    return snapshot


class Recovery:
    """Registrations made at start, each resuming from the snapshot's sequence number when
    the snapshot has the very same registration."""

    def __init__(self, manager: ServiceManager, snapshot: Snapshot | None) -> None:
        self.manager = manager
        self.snapshot = snapshot
        self.resumed: set[str] = set()  # streams whose blocks come from the snapshot

    async def register(self, registration: Registration) -> bool:
        resume = self.snapshot.resume_after(registration) if self.snapshot else None
        registered = await self.manager.register(registration, resume)
        if registered and resume is not None:
            self.resumed.add(registration.key)
        return registered

    def restore_blocks(self, snapshots: Snapshots) -> None:
        assert self.snapshot is not None
        restored = restore_blocks(self.manager.table, self.snapshot, self.resumed)
        snapshots.metrics.restored_blocks.set(restored)
        log.info(
            "snapshot restored source=%s blocks=%d streams_resumed=%d",
            self.snapshot.source,
            restored,
            len(self.resumed),
        )


async def restore(recovery: Recovery, state: StateFile, allowlist: EndpointAllowlist) -> None:
    """Registrations persisted by an earlier run, after the config file's: a conflict or an
    endpoint the allowlist no longer has is logged and skipped (and forgotten)."""
    for registration in state.load():
        try:
            allowlist.check(registration)
            await recovery.register(registration)
        except (RegistrationConflict, RegistrationFailed, EndpointRefused) as error:
            log.warning("state file %s: skipped %s: %s", state.path, registration.key, error)
            await state.remove(registration.key)


async def adopt(
    recovery: Recovery, snapshot: Snapshot, state: StateFile | None, allowlist: EndpointAllowlist
) -> None:
    """The snapshot's registrations that are not made yet (a peer's streams), persisted
    like /register's; a conflict or an endpoint the allowlist refuses is logged and skipped."""
    for registration in snapshot.registrations:
        try:
            allowlist.check(registration)
            if await recovery.register(registration) and state is not None:
                await state.add(registration)
        except REFUSED_AT_START as error:
            log.warning("snapshot %s: skipped %s: %s", snapshot.source, registration.key, error)


def _allowlist(settings: Settings, registrations: list[Registration]) -> EndpointAllowlist:
    if settings.register_allow is None:
        return EndpointAllowlist.default(registrations)
    return EndpointAllowlist.parse(settings.register_allow)
