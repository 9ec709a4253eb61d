"""structlog set-up, called once from the entry point.

JSON lines when stderr is not a terminal (journald, files), readable lines on
a terminal. Nothing logs per protocol message at info level.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import msgspec
import structlog

_ENCODER = msgspec.json.Encoder()


def _json(obj: object, **_: object) -> str:
    """structlog's JSON serializer: msgspec, several times faster than json.dumps."""
    return _ENCODER.encode(obj).decode()


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=_json) if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
