"""``mooncake-register`` (also ``python -m fleet.registrar``). Exit codes: 0 after a signal
(the streams unregistered), 1 when start-up cannot go on (the engine never healthy, what
it serves unknown, the health port taken), 2 for a bad flag or env var."""

from __future__ import annotations

import logging
import sys

from conductor.runtime import configure_logging, run

from .service import EXIT_FAILED, RegistrarFailed, serve
from .settings import parse_settings, summary


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    logging.getLogger("fleet.registrar").info("starting %s", summary(settings))
    try:
        code = run(serve(settings))
    except RegistrarFailed as error:
        print(f"mooncake-register: {error}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(code)


if __name__ == "__main__":
    main()
