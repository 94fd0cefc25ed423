"""What every command of the project starts the same way: logging and the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def configure_logging(level: str) -> None:
    """Structured ``key=value`` lines on stderr."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster sockets), else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
