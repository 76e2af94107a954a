"""Logging for the command line and the processes it starts (the engine's, the front-ends'): one
format on stderr, uvicorn's loggers at the same level, its access log only at debug."""
from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(getattr(logging, level.upper()))
    logging.getLogger("uvicorn.access").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
