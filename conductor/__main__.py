"""``mooncake-conductor``: start the indexer service (Go conductor's flags and env vars)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from aiohttp import web
from pydantic import ValidationError

from .api import create_app
from .config import (
    DEFAULT_CONFIG_PATH,
    ConductorConfig,
    ConfigError,
    Settings,
    load_config,
    one_line,
)
from .index import PrefixCacheTable
from .kv_store_watch import StoreWatch
from .manager import RegistrationConflict, RegistrationFailed, ServiceManager
from .metrics import ConductorMetrics
from .runtime import configure_logging, run

log = logging.getLogger("conductor")
SHUTDOWN_GRACE_SECONDS = 1.5


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, ConductorConfig]:
    parser = argparse.ArgumentParser(
        prog="mooncake-conductor", description="Global KV-cache indexer service."
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help="HTTP port (default: http_server_port or 13333)")
    parser.add_argument(
        "--config",
        default=os.environ.get("CONDUCTOR_CONFIG_PATH", DEFAULT_CONFIG_PATH),
        help="config file (env CONDUCTOR_CONFIG_PATH; a missing file means no services)",
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("CONDUCTOR_LOG_LEVEL", "INFO"), help=argparse.SUPPRESS
    )
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--replay-timeout", type=float, default=2.0, help="seconds")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    settings = Settings(
        host=args.host,
        port=args.port if args.port is not None else config.http_server_port,
        config_path=args.config,
        log_level=args.log_level,
        max_body_bytes=args.max_body_bytes,
        replay_timeout_seconds=args.replay_timeout,
    )
    return settings, config


async def serve(settings: Settings, config: ConductorConfig) -> None:
    """Run until SIGINT/SIGTERM, then close every socket and task."""
    table = PrefixCacheTable()
    metrics = ConductorMetrics(table)
    stores = StoreWatch(table, metrics, config.store_admin_url, config.kv_store_check_interval_s)
    manager = ServiceManager(table, metrics, stores, settings.replay_timeout_seconds)
    for registration in config.registrations():
        await manager.register(registration)
    runner = web.AppRunner(
        create_app(manager, settings.max_body_bytes),
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_SECONDS,
    )
    await runner.setup()
    gc.freeze()  # start-up objects live forever: keep full collections off the query path
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
        log.info(
            "listening host=%s port=%d services=%d",
            settings.host,
            settings.port,
            len(manager.registrations),
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        await manager.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    try:
        settings, config = parse_settings(argv)
    except (ConfigError, ValidationError) as error:
        message = one_line(error) if isinstance(error, ValidationError) else str(error)
        sys.exit(f"mooncake-conductor: invalid configuration: {message}")
    configure_logging(settings.log_level)
    try:
        run(serve(settings, config))
    except (RegistrationConflict, RegistrationFailed) as error:
        sys.exit(f"mooncake-conductor: invalid configuration: {error}")
    except OSError as error:
        sys.exit(f"mooncake-conductor: cannot serve on {settings.host}:{settings.port}: {error}")


if __name__ == "__main__":
    main()
