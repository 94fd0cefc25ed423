"""``mooncake-router``: the cache-aware OpenAI-compatible proxy."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web
from pydantic import ValidationError

from conductor.config import one_line
from conductor.runtime import add_common_flags, configure_logging, new_event_loop

from . import config as router_config
from .app import Router, create_app
from .tokenizer import TokenizerUnavailable

ACCESS_LOG_FORMAT = 'remote=%a request="%r" status=%s bytes=%b seconds=%Tf'


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mooncake-router", description="Cache-aware OpenAI-compatible proxy."
    )
    router_config.add_cli_flags(parser)
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (logger router.access, at INFO)",
    )
    add_common_flags(parser, "ROUTER_LOG_LEVEL")
    args = parser.parse_args(argv)
    try:
        config = router_config.load(args)
    except (OSError, ValueError) as error:
        reason = one_line(error) if isinstance(error, ValidationError) else str(error)
        sys.exit(f"mooncake-router: invalid configuration: {reason}")
    configure_logging(args.log_level)
    try:
        router = Router(config)
    except TokenizerUnavailable as error:
        sys.exit(f"mooncake-router: tokenizer: {error}")
    web.run_app(
        create_app(router),
        host=args.host,
        port=args.port,
        access_log=logging.getLogger("router.access") if args.access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        handler_cancellation=True,  # a client that goes away cancels its upstream request
        shutdown_timeout=0.5,  # SIGINT/SIGTERM: in-flight requests are cut within ~1 s
        loop=new_event_loop(),
        print=None,
    )


if __name__ == "__main__":
    main()
