"""``mooncake-router``: the cache-aware OpenAI-compatible proxy."""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web
from pydantic import ValidationError

from conductor.config import one_line
from conductor.runtime import configure_logging, new_event_loop

from . import config as router_config
from .app import Router, create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mooncake-router", description="Cache-aware OpenAI-compatible proxy."
    )
    router_config.add_cli_flags(parser)
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)
    parser.add_argument("--log-level", default=os.environ.get("ROUTER_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    try:
        config = router_config.load(args)
    except (OSError, ValueError) as error:
        reason = one_line(error) if isinstance(error, ValidationError) else str(error)
        sys.exit(f"mooncake-router: invalid configuration: {reason}")
    configure_logging(args.log_level)
    web.run_app(
        create_app(Router(config, args.max_body_bytes)),
        host=args.host,
        port=args.port,
        access_log=None,
        handler_cancellation=True,  # a client that goes away cancels its upstream request
        shutdown_timeout=1.5,
        loop=new_event_loop(),
        print=None,
    )


if __name__ == "__main__":
    main()
