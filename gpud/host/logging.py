"""structlog set-up, called by the entry point at start and again by a reload.

JSON lines when stderr is not a terminal (journald, files), readable lines on
a terminal. Nothing logs per protocol message at info level.

Logging never raises into the daemon: a line that cannot be written (a full
disk under a log file, a closed pipe) is dropped and counted, and the next line
that can be written is preceded by a ``log_lines_dropped`` line with the count.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal, TextIO

import msgspec
import structlog

_ENCODER = msgspec.json.Encoder()


def _json(obj: object, **_: object) -> str:
    """structlog's JSON serializer: msgspec, several times faster than json.dumps."""
    return _ENCODER.encode(obj).decode()


class LineWriter:
    """structlog's logger: one ``write(2)`` per line on stderr's descriptor (no buffer
    left holding half a line after a failure), never an exception."""

    def __init__(self, file: TextIO, *, json: bool) -> None:
        self._file = file
        self._json = json
        self.dropped = 0
        try:
            self._fd: int | None = file.fileno()
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (tests)
            self._fd = None

    def msg(self, message: str) -> None:
        if self.dropped and self._write(self._dropped_line()):
            self.dropped = 0
        if not self._write(message):
            self.dropped += 1

    def _dropped_line(self) -> str:
        if self._json:
            return f'{{"event":"log_lines_dropped","count":{self.dropped},"level":"warning"}}'
        return f"[warning  ] log_lines_dropped              count={self.dropped}"

    def _write(self, line: str) -> bool:
        data = line + "\n"
        try:
            if self._fd is None:
                self._file.write(data)
                self._file.flush()
            else:
                os.write(self._fd, data.encode(errors="replace"))
        except (OSError, ValueError):  # EFBIG, ENOSPC, EPIPE, a closed stream
            return False
        return True

    log = debug = info = warn = warning = error = err = critical = exception = fatal = failure = msg


class _LineWriterFactory:
    def __init__(self, writer: LineWriter) -> None:
        self.writer = writer

    def __call__(self, *args: Any) -> LineWriter:
        return self.writer


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Debug:
    """Whether debug lines are written: per-message debug lines are skipped whole when not
    (a filtered structlog call still costs its arguments and a proxy lookup)."""

    on = False


debug = _Debug()


def configure_logging(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    debug.on = _LEVELS[level] <= logging.DEBUG
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
        logger_factory=_LineWriterFactory(LineWriter(sys.stderr, json=use_json)),
        # Not cached: a reload that changes log_level or log_format must reach the loggers already
        # used (a cached one keeps the level and renderer of its first use); ~1.5 us more a line.
        cache_logger_on_first_use=False,
    )
