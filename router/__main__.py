"""``mooncake-router``: the cache-aware OpenAI-compatible proxy.

Its configuration and tokenizer are checked first; then it binds its port and serves at
once: registering with the conductors goes on in the background, and until a conductor
answers, requests are routed by load and ``/health`` says ``degraded`` and why.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
import sys

from aiohttp import web

from conductor.failures import cannot_listen, host_port
from conductor.runtime import add_common_flags, configure_logging, interruptible, run
from tokenization.tokenizer import TokenizerUnavailable

from . import config as router_config
from .app import Router, create_app
from .keys import KeysFileError
from .tracing import TracingUnavailable

log = logging.getLogger("router")
ACCESS_LOG_FORMAT = 'remote=%a request="%r" status=%s bytes=%b seconds=%Tf'
SHUTDOWN_TIMEOUT_S = 0.5  # SIGINT/SIGTERM: in-flight requests are cut within ~1 s


class CannotListen(Exception):
    """The address is taken, unknown or not ours: one line, not a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-router",
        description="Cache-aware OpenAI-compatible proxy: asks the conductor where each "
        "prompt's prefix is cached and forwards the request there.",
    )
    router_config.add_cli_flags(parser)
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (logger router.access, at INFO)",
    )
    add_common_flags(parser, "ROUTER_LOG_LEVEL")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = router_config.load(args)
    except ValueError as error:  # ConfigError, or a flag pair that does not add up
        sys.exit(f"mooncake-router: invalid configuration: {error}")
    configure_logging(args.log_level)
    try:
        with interruptible():  # loading tokenizers may take a while: a stop is heard then too
            run(serve(Router(config), args))
    except KeyboardInterrupt:  # stopped while starting, as asked
        pass
    except TokenizerUnavailable as error:
        sys.exit(f"mooncake-router: tokenizer: {error}")
    except KeysFileError as error:
        sys.exit(f"mooncake-router: keys: {error}")
    except TracingUnavailable as error:
        sys.exit(f"mooncake-router: tracing: {error}")
    except CannotListen as error:
        sys.exit(f"mooncake-router: {error}")


def listen(host: str, port: int) -> list[socket.socket]:
    """A listening socket on every address ``host`` resolves to (as asyncio binds them:
    address reuse, IPv6 sockets IPv6 only); raises CannotListen with the system's reason."""
    sockets: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, *_, address in dict.fromkeys(found):
            sockets.append(socket.create_server(address, family=family, backlog=128))
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise CannotListen(cannot_listen(host, port, error)) from None
    return sockets


async def serve(router: Router, args: argparse.Namespace) -> None:
    """Bind the port (before anything else runs, so a taken port is the only line), then
    serve until SIGINT/SIGTERM. The router's start (sessions, background tasks) waits on
    nothing remote, so requests are answered at once."""
    sockets = listen(args.host, args.port)
    try:
        await serve_on(router, sockets, args.access_log)
    finally:
        for sock in sockets:
            sock.close()


async def serve_on(router: Router, sockets: list[socket.socket], access_log: bool) -> None:
    """Serve on the listening ``sockets`` until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if router.keys.enabled:  # reread the keys file now, as well as when it changes
        loop.add_signal_handler(signal.SIGHUP, router.keys.reload)
    runner = web.AppRunner(
        create_app(router),
        access_log=logging.getLogger("router.access") if access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        handler_cancellation=True,  # a client that goes away cancels its upstream request
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    gc.freeze()  # start-up objects (tokenizers, keys, config) live forever: keep full
    # collections, ~45 ms over them with 1,000 keys (bench.gateway_overhead), off requests
    try:
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        for sock in sockets:
            host, port = sock.getsockname()[:2]
            log.info("listening on http://%s", host_port(host, port))
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    main()
