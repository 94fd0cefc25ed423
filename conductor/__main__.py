"""``mooncake-conductor``: start the indexer service (Go conductor's flags and env vars).

Every setting is a config-file key, an env var ``CONDUCTOR_<KEY>`` and a flag; a flag wins
over the env, the env over the file, the file over the default (docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from .api import API
from .config import (
    DEFAULT_CONFIG_PATH,
    ConductorConfig,
    ConfigError,
    Settings,
    load_config,
    one_line,
    settings_model,
)
from .failures import cannot_listen
from .http_guard import GuardedSite, connection_protocol, listen
from .manager import CapacityExceeded, RegistrationConflict, RegistrationFailed
from .query_thread import QueryThreadShell
from .runtime import add_common_flags, configure_logging, port_number, run
from .service import GUARD, MANAGER, create_app, state_path
from .stream_limits import StreamLimits

log = logging.getLogger("conductor")
SHUTDOWN_GRACE_SECONDS = 1.0
LINGER_SECONDS = 1.0  # reading an unwanted body's rest before closing (aiohttp's default: 10)
ENV_PREFIX = "CONDUCTOR_"
# settings whose flag or env var is not derived from the key (Go's names)
FLAGS = {
    "http_server_port": ("--port",),
    "replay_timeout_s": ("--replay-timeout-s", "--replay-timeout"),
}
ENVS = {"http_server_port": "CONDUCTOR_PORT"}
LIMIT_KEYS = tuple(item.name for item in dataclasses.fields(StreamLimits))


class CannotListen(Exception):
    """The HTTP socket cannot be bound (the port is in use, the host is no address here)."""


def setting_flags(key: str) -> tuple[str, ...]:
    return FLAGS.get(key, ("--" + key.replace("_", "-"),))


def setting_env(key: str) -> str:
    return ENVS.get(key, ENV_PREFIX + key.upper())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-conductor",
        description="Global KV-cache indexer service. Every option is also an env var and "
        "a config-file key: flag > env > file > default.",
    )
    parser.add_argument(
        "--config",
        help="config file (env CONDUCTOR_CONFIG_PATH; default "
        f"{DEFAULT_CONFIG_PATH}, which may be missing; a path given must exist)",
    )
    add_common_flags(parser, "CONDUCTOR_LOG_LEVEL")
    parser.set_defaults(log_level=None)  # unset: the env, the file or the default says
    for key, spec in settings_model().model_fields.items():
        if key == "log_level":
            continue
        options: dict[str, Any] = {"dest": key, "default": None}
        if spec.annotation is bool:  # one on by default is turned off with --no-<flag>
            options["action"] = argparse.BooleanOptionalAction if spec.default else "store_true"
        elif key == "register_allow":
            options.update(action="append", metavar="ENTRY")
        elif key == "http_server_port":
            options.update(type=port_number, metavar="PORT")
        elif key == "rpc_server_port":
            options.update(metavar="PORT")
        help_text = (
            f"{spec.description} (env {setting_env(key)}, key {key}; default {spec.default!r})"
        )
        parser.add_argument(*setting_flags(key), help=help_text, **options)
    return parser


def _from_env(key: str, raw: str) -> Any:
    """Env values are strings; a list is comma-separated."""
    return [entry for entry in raw.split(",") if entry.strip()] if key == "register_allow" else raw


def parse_settings(
    argv: list[str] | None = None,
) -> tuple[Settings, StreamLimits, ConductorConfig, str]:
    """Flags, env and file merged by precedence, and the config file's path; raises
    ``ConfigError`` naming the source of a bad value."""
    given = vars(_parser().parse_args(argv))
    args = {key: value for key, value in given.items() if value is not None}
    config_path = args.pop("config", None) or os.environ.get("CONDUCTOR_CONFIG_PATH")
    if config_path and not Path(os.path.expanduser(config_path)).exists():
        raise ConfigError(f"config file {config_path} does not exist")
    config_path = config_path or DEFAULT_CONFIG_PATH
    config = load_config(config_path)
    values: dict[str, Any] = dict(config.settings)
    sources = dict.fromkeys(values, os.path.expanduser(config_path))
    for key in settings_model().model_fields:
        raw = os.environ.get(setting_env(key))
        if raw is not None:
            values[key], sources[key] = _from_env(key, raw), setting_env(key)
        if key in args:
            values[key], sources[key] = args[key], "/".join(setting_flags(key))
    try:
        settings = settings_model().model_validate(values)
        limits = StreamLimits(**{key: getattr(settings, key) for key in LIMIT_KEYS})
    except ValidationError as error:
        key = str(error.errors()[0]["loc"][0])
        raise ConfigError(f"{sources.get(key, key)}: {one_line(error)}") from None
    except ValueError as error:  # StreamLimits' own checks name the fields
        named = sorted({sources[key] for key in LIMIT_KEYS if key in sources and key in str(error)})
        raise ConfigError(f"{', '.join(named)}: {error}" if named else str(error)) from None
    return settings, limits, config, config_path


async def serve(
    settings: Settings, limits: StreamLimits, config: ConductorConfig, config_path: str
) -> None:
    """Run until SIGINT/SIGTERM, then close every connection, socket and task."""
    path = state_path(settings, config_path)
    app = create_app(settings, limits, config, path)
    guard = app[GUARD]
    runner = web.AppRunner(
        app,
        access_log=logging.getLogger("conductor.access") if settings.access_log else None,
        shutdown_timeout=SHUTDOWN_GRACE_SECONDS,
        keepalive_timeout=settings.keepalive_timeout_s,
        lingering_time=LINGER_SECONDS,
    )
    host, port = settings.host, settings.http_server_port
    try:  # before anything starts: a port in use must not leave streams registered
        # the query thread's sockets share the port (conductor.query_thread)
        server = await listen(runner, guard, host, port, reuse_port=settings.query_thread)
    except OSError as error:
        raise CannotListen(cannot_listen(host, port, error)) from None
    try:
        await runner.setup()  # runs the cleanup_ctx: registrations, store checks, loop lag
    except BaseException:
        server.close()
        raise
    gc.freeze()  # start-up objects live forever: keep full collections off the query path
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    thread: QueryThreadShell | None = None
    try:
        site = GuardedSite(runner, guard, server, host=host, port=port)
        await site.start()
        if settings.query_thread:
            thread = QueryThreadShell(app[API], guard, server, connection_protocol(runner, guard))
            thread.start()
        log.info(
            "listening host=%s port=%d services=%d state_file=%s",
            settings.host,
            settings.http_server_port,
            len(app[MANAGER].registrations),
            path or "-",
        )
        if settings.rpc_server_port:
            log.warning(
                "rpc_server_port=%d is not served: this conductor speaks HTTP only "
                "(docs/compatibility.md)",
                settings.rpc_server_port,
            )
        if config.services:
            log.warning(
                "the services list is not read, as upstream's conductor does not read it: "
                "list event streams under kvevent_instance"
            )
        await stop.wait()
        log.info("shutting down")
    finally:
        if thread is not None:
            thread.stop()
        guard.close_all()  # slow clients must not hold the shutdown
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    try:
        settings, limits, config, config_path = parse_settings(argv)
    except ConfigError as error:
        sys.exit(f"mooncake-conductor: invalid configuration: {error}")
    configure_logging(settings.log_level)
    try:
        run(serve(settings, limits, config, config_path))
    except CannotListen as error:
        sys.exit(f"mooncake-conductor: {error}")
    except ConfigError as error:  # the state file
        sys.exit(f"mooncake-conductor: invalid configuration: {error}")
    except (RegistrationConflict, RegistrationFailed, CapacityExceeded) as error:
        # only the config file's registrations raise: the state file's are skipped
        where = os.path.expanduser(config_path)
        sys.exit(f"mooncake-conductor: invalid configuration: {where}: {error}")


if __name__ == "__main__":
    main()
