"""GPU naming and sizes: pure parsing shared by the daemon, gpuctl and config.

A GPU is named by its index (``0``), a key (``gpu:0``) or its UUID
(``GPU-8f2c…``). Sizes are bytes or a number with a binary or decimal unit
(``512MiB``, ``80GiB``, ``16GB``). Parsers raise ``ValueError`` naming what was
wrong; they never guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpud_client.units import parse_bytes

__all__ = ["GpuIdentity", "parse_bytes", "parse_simulate", "resolve_gpu"]

_SIMULATE = re.compile(r"^\s*(\d+)\s*(?:x\s*(.+))?$")
DEFAULT_SIMULATED_MEMORY = 80 * 2**30
MAX_GPUS = 64


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    index: int
    uuid: str


def parse_simulate(spec: str) -> tuple[int, int]:
    """'2' or '2x80GiB' -> (count, memory bytes per GPU)."""
    m = _SIMULATE.match(spec)
    if not m:
        raise ValueError(f"bad --simulate value {spec!r}: expected N or NxSIZE, such as 2 or 2x80GiB")
    count = int(m.group(1))
    if not 1 <= count <= MAX_GPUS:
        raise ValueError(f"bad --simulate value {spec!r}: GPU count must be 1..{MAX_GPUS}")
    try:
        memory = parse_bytes(m.group(2)) if m.group(2) else DEFAULT_SIMULATED_MEMORY
    except ValueError as exc:
        raise ValueError(f"bad --simulate value {spec!r}: {exc}") from None
    if memory <= 0:
        raise ValueError(f"bad --simulate value {spec!r}: memory must be positive")
    return count, memory


def resolve_gpu(ref: int | str, gpus: list[GpuIdentity]) -> int:
    """Index, 'gpu:N', 'N' or a UUID -> index. ValueError names the reference."""
    by_index = {g.index for g in gpus}
    index: int | None = None
    if isinstance(ref, int):
        index = ref
    elif ref.startswith("gpu:") and ref[4:].isdigit():
        index = int(ref[4:])
    elif ref.isdigit():
        index = int(ref)
    else:
        for g in gpus:
            if g.uuid.lower() == ref.lower():
                return g.index
    if index is None or index not in by_index:
        known = ", ".join(str(g.index) for g in gpus) or "none"
        raise ValueError(f"unknown GPU {ref!r} (this node has GPUs {known})")
    return index
