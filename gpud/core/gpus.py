"""GPU naming and sizes: pure parsing shared by the daemon, gpuctl and config.

A GPU is named by its index (``0``), a key (``gpu:0``) or its UUID
(``GPU-8f2c…``). Sizes are bytes or a number with a binary or decimal unit
(``512MiB``, ``80GiB``, ``16GB``). Parsers raise ``ValueError`` naming what was
wrong; they never guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIMULATE = re.compile(r"^\s*(\d+)\s*(?:x\s*(.+))?$")
DEFAULT_SIMULATED_MEMORY = 80 * 2**30
MAX_GPUS = 64


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    index: int
    uuid: str


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592. Whole bytes only; negative or unknown units refused."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected bytes or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    number, unit = m.groups()
    factor = _UNITS.get(unit.upper())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
    value = float(number) * factor if "." in number else int(number) * factor
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


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
