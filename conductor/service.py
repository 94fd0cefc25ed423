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
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from .api import ApiOptions, HttpLimits, api_app
from .config import ConductorConfig, Registration, Settings
from .http_guard import ConnectionGuard
from .index import PrefixCacheTable
from .kv_store_watch import StoreWatch
from .manager import RegistrationConflict, RegistrationFailed, ServiceManager
from .metrics import ConductorMetrics
from .persistence import StateFile
from .runtime import GcPauseMonitor, LoopLagMonitor
from .security import BearerAuth, EndpointAllowlist, EndpointRefused
from .stream_limits import StreamLimits

log = logging.getLogger("conductor")

MANAGER = web.AppKey("manager", ServiceManager)
GUARD = web.AppKey("guard", ConnectionGuard)  # the serving socket's; in-process tests skip it


def state_path(settings: Settings, config_path: str) -> Path | None:
    """Persistence is on by default, beside the config file and per port (two conductors
    started from one directory do not share a file); an empty ``state_file`` turns it off."""
    if settings.state_file is not None:
        return Path(os.path.expanduser(settings.state_file)) if settings.state_file else None
    config_dir = Path(os.path.expanduser(config_path)).parent
    return config_dir / f"conductor_state.{settings.http_server_port}.json"


def index_manager(config: ConductorConfig, limits: StreamLimits) -> ServiceManager:
    """The index and what feeds it: the streams' subscribers, the store checks, metrics.
    The service serves it over HTTP; a router with ``conductor.embedded`` asks it itself."""
    table = PrefixCacheTable()
    metrics = ConductorMetrics(table)
    stores = StoreWatch(table, metrics, config.store_admin_url, config.kv_store_check_interval_s)
    return ServiceManager(table, metrics, stores, limits)


def create_app(
    settings: Settings, limits: StreamLimits, config: ConductorConfig, state: Path | None
) -> web.Application:
    """The service, ready to run (``state``: the registrations file, None to keep none)."""
    manager = index_manager(config, limits)
    metrics = manager.metrics
    allowlist = _allowlist(settings, config.registrations())
    state_file = StateFile(state) if state is not None else None
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
    )
    app = api_app(manager, options)
    app[MANAGER] = manager
    app[GUARD] = guard
    lag = LoopLagMonitor(metrics.registry, "conductor")
    gc_pauses = GcPauseMonitor(metrics.registry, "conductor")
    app.cleanup_ctx.append(
        _running(manager, lag, gc_pauses, config.registrations(), state_file, allowlist)
    )
    return app


def _running(
    manager: ServiceManager,
    lag: LoopLagMonitor,
    gc_pauses: GcPauseMonitor,
    registrations: list[Registration],
    state: StateFile | None,
    allowlist: EndpointAllowlist,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def running(_: web.Application) -> AsyncIterator[None]:
        """Registrations indexed before the first request; everything stopped after the
        last one. A conflicting config file raises here, and the app does not start."""
        try:
            for registration in registrations:
                await manager.register(registration)
            if state is not None:
                await restore(manager, state, allowlist)
            lag.start()
            gc_pauses.start()
            yield
        finally:
            gc_pauses.stop()
            await lag.stop()
            await manager.close()

    return running


async def restore(manager: ServiceManager, state: StateFile, allowlist: EndpointAllowlist) -> None:
    """Registrations persisted by an earlier run, after the config file's: a conflict or an
    endpoint the allowlist no longer has is logged and skipped (and forgotten)."""
    for registration in state.load():
        try:
            allowlist.check(registration)
            await manager.register(registration)
        except (RegistrationConflict, RegistrationFailed, EndpointRefused) as error:
            log.warning("state file %s: skipped %s: %s", state.path, registration.key, error)
            await state.remove(registration.key)


def _allowlist(settings: Settings, registrations: list[Registration]) -> EndpointAllowlist:
    if settings.register_allow is None:
        return EndpointAllowlist.default(registrations)
    return EndpointAllowlist.parse(settings.register_allow)
