"""Sizes and amounts as people write them: bytes, or a number with a binary or decimal unit; GPUs in fixed point.

Shared by the client library, gpuctl and the daemon's configuration. Refuses
rather than guesses: a negative size, an unknown unit or a fraction of a byte
is a ValueError that names the input.
"""

from __future__ import annotations

import math
import re

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


GPU_UNIT = 10_000  # GPUs are counted in 1/10000 of one, so four quarters make exactly one


def fixed_gpus(gpus: float) -> int:
    """GPUs as people and the wire write them (a float) in 1/``GPU_UNIT``; ValueError if not exact."""
    if not math.isfinite(gpus):
        raise ValueError(f"gpus must be a number, got {gpus}")
    fixed = round(gpus * GPU_UNIT)
    if abs(gpus * GPU_UNIT - fixed) > 1e-6:
        raise ValueError(f"gpus {gpus} is finer than 1/{GPU_UNIT} of a GPU")
    return fixed


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592. Whole bytes only; negative or unknown units refused."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(
            f"not a size: {text!r} (expected bytes or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    number, unit = m.groups()
    factor = _UNITS.get(unit.upper())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
    value = float(number) * factor if "." in number else int(number) * factor
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(n: int) -> str:
    """8589934592 -> '8GiB'; exact when it can be, else one decimal."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            value = n / factor
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(text: str) -> str:
    """``text`` with control characters shown as ``\\xNN``: safe to print on a terminal.
    The daemon refuses them in names it is sent, but tables show what NVML or an older
    daemon says too."""
    return text.translate(_CONTROL)
