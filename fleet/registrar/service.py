"""The registrar's life: wait for the engine, learn it, keep it registered with every
conductor, and at SIGTERM (or SIGINT) unregister it from all of them within
``unregister_timeout_s``, then exit 0.

Its own ``GET /health`` (``health_host:health_port``) answers 200 once every stream is
registered with at least one conductor, else 503; the body says, per conductor, which
streams it holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from conductor.failures import cannot_listen, describe

from .engine import EngineNotHealthy, learn, wait_healthy
from .keeper import ConductorKeeper
from .settings import Settings
from .streams import EngineFacts, StreamError, is_wildcard, registration_bodies

log = logging.getLogger("fleet.registrar")

LEARN_ATTEMPTS = 3
LEARN_RETRY_S = 2.0
EXIT_OK, EXIT_FAILED = 0, 1


class RegistrarFailed(Exception):
    """Start-up could not go on: the engine never became healthy, or what it serves could
    not be learnt. The message says what, and which flag helps."""


def default_advertise_host() -> str:
    """The hostname's address: in a pod, its IP (kubelet writes it to /etc/hosts)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Registrar:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.phase = "waiting for engine"
        self.facts: EngineFacts | None = None
        self.keepers: list[ConductorKeeper] = []
        self.started = time.monotonic()

    # -- /health ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Every stream is registered with at least one conductor."""
        if not self.keepers or self.phase != "registered":
            return False
        ranks = self.keepers[0].states.keys()
        return all(
            any(keeper.states[rank] == "registered" for keeper in self.keepers) for rank in ranks
        )

    def view(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "status": "ok" if self.ready else self.phase,
            "phase": self.phase,
            "instance_id": self.settings.instance_id,
            "tenant_id": self.settings.tenant_id,
            "engine": self.settings.engine_url,
            "model": facts.model if facts else None,
            "block_size": facts.block_size if facts else None,
            "streams": list(self.keepers[0].bodies) if self.keepers else [],
            "conductors": {keeper.url: keeper.view() for keeper in self.keepers},
        }

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.view(), status=200 if self.ready else 503)

    async def start_health_server(self) -> web.AppRunner | None:
        settings = self.settings
        if settings.health_port == 0:
            return None
        app = web.Application()
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, settings.health_host, settings.health_port)
        try:
            await site.start()
        except OSError as error:
            await runner.cleanup()
            raise RegistrarFailed(
                cannot_listen(settings.health_host, settings.health_port, error)
            ) from None
        return runner

    # -- start-up --------------------------------------------------------------------------
    async def _learn(self, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        settings = self.settings
        for attempt in range(1, LEARN_ATTEMPTS + 1):
            try:
                self.facts = await learn(session, settings)
                break
            except StreamError as error:
                if attempt == LEARN_ATTEMPTS:
                    raise RegistrarFailed(f"cannot tell what the engine serves: {error}") from None
                log.warning("learning the engine failed attempt=%d error=%s", attempt, error)
                await asyncio.sleep(LEARN_RETRY_S)
        assert self.facts is not None
        host = settings.advertise_host
        if host is None:
            host = default_advertise_host()
            if any(is_wildcard(stream.endpoint) for stream in self.facts.streams):
                log.info(
                    "advertise_host=%s (the hostname's address; set REGISTRAR_ADVERTISE_HOST "
                    "to the pod IP to choose)", host,
                )  # fmt: skip
        try:
            return registration_bodies(
                self.facts,
                instance_id=settings.instance_id,
                tenant_id=settings.tenant_id,
                engine_type=settings.type,
                advertise_host=host,
                kv_store=settings.kv_store,
            )
        except StreamError as error:
            raise RegistrarFailed(f"cannot register the engine's streams: {error}") from None

    async def run(self, stop: asyncio.Event) -> int:
        """Until ``stop`` is set (a signal): the exit code."""
        settings = self.settings
        timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            log.info("waiting for engine url=%s timeout_s=%g", settings.engine_url,
                     settings.engine_timeout_s)  # fmt: skip
            waited = asyncio.ensure_future(
                wait_healthy(session, settings.engine_url, settings.engine_timeout_s)
            )
            if not await _until(waited, stop):
                log.info("stopped before the engine was healthy: nothing to unregister")
                return EXIT_OK
            try:
                log.info("engine healthy url=%s after_s=%.1f", settings.engine_url,
                         waited.result())  # fmt: skip
            except EngineNotHealthy as error:
                raise RegistrarFailed(str(error)) from None
            self.phase = "learning the engine"
            bodies = await self._learn(session)
            assert self.facts is not None
            log.info(
                "engine serves model=%s block_size=%d dp_ranks=%s; registering with %s",
                self.facts.model, self.facts.block_size,
                [stream.rank for stream in self.facts.streams], ", ".join(settings.conductor),
            )  # fmt: skip
            self.keepers = [
                ConductorKeeper(session, url, bodies, settings.interval_s, settings.auth_token)
                for url in settings.conductor
            ]
            self.phase = "registered"
            tasks = [
                asyncio.create_task(keeper.keep(), name=f"keep {keeper.url}")
                for keeper in self.keepers
            ]
            await stop.wait()
            self.phase = "unregistering"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.unregister()
        return EXIT_OK

    async def unregister(self) -> None:
        """From every conductor at once, within ``unregister_timeout_s``."""
        limit = self.settings.unregister_timeout_s
        started = time.monotonic()
        jobs = [asyncio.ensure_future(keeper.unregister_all()) for keeper in self.keepers]
        done, pending = await asyncio.wait(jobs, timeout=limit)
        for job in pending:
            job.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        withdrawn = [
            keeper.url
            for keeper, job in zip(self.keepers, jobs, strict=True)
            if job in done and not job.cancelled() and job.exception() is None and job.result()
        ]
        if pending:
            log.warning(
                "unregistering took over %g s: gave up on %s", limit,
                ", ".join(k.url for k, j in zip(self.keepers, jobs, strict=True) if j in pending),
            )  # fmt: skip
        log.info(
            "unregistered from %d of %d conductors in %.0f ms",
            len(withdrawn), len(self.keepers), 1000 * (time.monotonic() - started),
        )  # fmt: skip


async def _until(task: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Waits for ``task`` unless ``stop`` comes first (then cancels it): True if it ended."""
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def serve(settings: Settings) -> int:
    """The registrar with its /health, stopped by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    registrar = Registrar(settings)
    runner = await registrar.start_health_server()
    if runner is not None:
        log.info("health http://%s:%d/health", settings.health_host, settings.health_port)
    try:
        return await registrar.run(stop)
    except RegistrarFailed as error:
        log.error("%s", error)
        raise
    except Exception as error:  # noqa: BLE001 - one line, then the traceback at DEBUG
        log.debug("registrar failed", exc_info=True)
        raise RegistrarFailed(describe(error)) from error
    finally:
        if runner is not None:
            await runner.cleanup()
