"""What the benchmarks here share: progress lines, and the record of the machine a run was measured on.

Every script prints its figures (a table, or one JSON object with ``--json``) on stdout and its progress
on stderr, so ``--json`` output stays one parseable line. Each report carries the machine record of
``Run.machine()``: the CPU count, the one-minute load before and after the run, and how long it took,
so a figure can be read against the load it was measured under.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def progress(message: str) -> None:
    """A progress line on stderr, at once."""
    print(message, file=sys.stderr, flush=True)


class Run:
    """One benchmark run: the load when it began, and when."""

    def __init__(self) -> None:
        self.load_before = os.getloadavg()[0]
        self.began = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.began

    def machine(self) -> dict[str, Any]:
        """The machine record: ``cpus``, ``loadavg_1m_before``, ``loadavg_1m_after``, ``elapsed_s``."""
        return {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(self.load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
            "elapsed_s": round(self.elapsed_s(), 1),
        }


def machine_line(m: dict[str, Any]) -> str:
    """The machine record as a table's last line says it."""
    return (
        f"{m['cpus']} CPUs, load {m['loadavg_1m_before']} before, {m['loadavg_1m_after']} after, "
        f"took {m['elapsed_s']} s"
    )
