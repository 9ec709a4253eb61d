"""argparse types held to the protocol's own limits, shared by gpuctl and gpud-run.

Each value a command line takes is checked against the protocol's types (so no
command keeps a copy of a limit), and each message names the bounds and the unit;
argparse adds the flag. ``Parser`` raises ``UsageError`` instead of printing and
exiting, so the command answers it (exit 2, in JSON where asked).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, get_args

import msgspec

from gpud_client import protocol as p
from gpud_client.units import fixed_gpus, parse_bytes, printable


class UsageError(Exception):
    """Bad input on the command line: exit 2, before anything is sent."""

    def __init__(self, message: str, usage: str = "", prog: str = "gpuctl") -> None:
        super().__init__(message)
        self.message, self.usage, self.prog = message, usage, prog


def gpu_ref(text: str) -> int | str:
    return int(text) if text.isascii() and text.isdigit() else text


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"


def bounds(limit: Any, scale: float = 1) -> str:
    meta = get_args(limit)[1]
    return f"{_num(meta.ge / scale)}..{_num(meta.le / scale)}"


def _limited(
    limit: Any, parse: Callable[[str], float], unit: str = "", *, what: str = "", scale: int = 1
) -> Callable[[str], Any]:
    """An argparse type held to one of the protocol's limits, so gpuctl keeps no copy of them.
    ``scale``: the protocol's units per the flag's (1000: the flag is in seconds, the wire in ms)."""
    subject = f"{what} " if what else ""
    unit = f" {unit}" if unit else ""
    whole = " (a whole number)" if parse is int else ""

    def check(text: str) -> Any:
        try:
            value = parse(text)
            return msgspec.convert(value if scale == 1 else round(value * scale), limit)
        except msgspec.ValidationError:  # a ValueError too: first
            raise argparse.ArgumentTypeError(f"{subject}must be {bounds(limit, scale)}{unit}, got {text}") from None
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{subject}must be {bounds(limit, scale)}{unit}{whole}, got {text!r}"
            ) from None

    return check


priority = _limited(p.Priority, int)
core_percent = _limited(p.CoreLimit, int, "percent of GPU time")
max_wait = _limited(p.Millis, int, "milliseconds")
hold_max = _limited(p.HoldMaxMs, int, "milliseconds")
queue_limit = _limited(p.QueueLimit, int, "waiting requests")
cpus = _limited(p.CpuCount, int, "CPU cores")
wait = _limited(p.Millis, float, "seconds", scale=1000)  # -> milliseconds, as the wire has them
tq = _limited(p.Seconds, float, "seconds", what="the time quantum")


PRIORITY_CLASSES = ", ".join(c.value for c in p.PriorityClass)


def priority_arg(text: str) -> int | str:
    if text in {c.value for c in p.PriorityClass}:
        return text
    try:
        return int(priority(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be {bounds(p.Priority)} or {PRIORITY_CLASSES}; got {text!r}") from None


def gpus(text: str) -> float:
    """A whole number of GPUs >= 1 or a fraction of one, exact to the ledger's 1/10000 (0: CPU cores alone)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value.is_integer() or 0 <= value < 1):  # nan and inf fail both
        raise argparse.ArgumentTypeError(
            f"must be a whole number of GPUs >= 1 or a fraction 0 < x < 1 of one GPU, got {text!r}"
        )
    try:
        msgspec.convert(value, p.Gpus)
        fixed_gpus(value)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(f"must be at most {_num(get_args(p.Gpus)[1].le)} GPUs, got {text}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


class GpuRange(NamedTuple):
    """An elastic request: at least ``min`` whole GPUs, at most ``max`` (ALLOCATE's gpus and gpus_max)."""

    min: int
    max: int


# ALLOCATE's own type for the maximum (less its None), so no command keeps a copy of its bound.
_GPUS_MAX = next(
    t
    for f in msgspec.structs.fields(p.Allocate)
    if f.name == "gpus_max"
    for t in get_args(f.type)
    if t is not type(None)
)
_RANGE = re.compile(r"(\d+)\.\.(\d+)", re.ASCII)


def gpu_range(text: str) -> GpuRange:
    """``MIN..MAX`` whole GPUs, 1 <= MIN < MAX: an elastic allocation, shrunk or grown in that range."""
    m = _RANGE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"an elastic range is MIN..MAX whole GPUs, e.g. 1..4; got {text!r}")
    low, high = int(m[1]), int(m[2])
    if low < 1:
        raise argparse.ArgumentTypeError(f"an elastic range needs MIN >= 1 whole GPU, got {text!r}")
    if high <= low:
        exact = f" (for exactly {low} GPU(s), give {low})" if high == low else ""
        raise argparse.ArgumentTypeError(f"an elastic range needs MAX > MIN, got {text!r}{exact}")
    try:
        msgspec.convert(high, _GPUS_MAX)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(
            f"an elastic range's MAX must be {bounds(_GPUS_MAX)} GPUs, got {text!r}"
        ) from None
    return GpuRange(low, high)


def gpus_or_range(text: str) -> float | GpuRange:
    """``--gpus`` where an elastic range is allowed: a number of GPUs (``gpus``) or ``MIN..MAX``."""
    return gpu_range(text) if ".." in text else gpus(text)


def owner_pid(text: str) -> int:
    """A process of this machine: the daemon reclaims the allocation of a dead owner at once."""
    try:
        pid: int = msgspec.convert(int(text), p.Pid)
    except (ValueError, msgspec.ValidationError):
        raise argparse.ArgumentTypeError(f"must be a process id {bounds(p.Pid)}, got {text!r}") from None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise argparse.ArgumentTypeError(
            f"no process {pid} on this machine: gpud would reclaim the allocation at once"
        ) from None
    except PermissionError:
        pass  # it exists, as another user's
    return pid


def _char(c: str) -> str:
    if c == " ":
        return "a space"
    return f"a control character ({printable(c)})" if printable(c) != c else repr(c)


def _text(limit: Any, noun: str) -> Callable[[str], str]:
    """An argparse type for a name whose length and characters the protocol limits."""
    meta = get_args(limit)[1]
    allowed = re.fullmatch(r"\^\[(A-Za-z0-9)?([^]^][^]]*)\]\+\$", meta.pattern)
    hint = f" (allowed: {'letters, digits and ' if allowed[1] else ''}{allowed[2]})" if allowed else ""

    def check(text: str) -> str:
        try:
            return str(msgspec.convert(text, limit))
        except msgspec.ValidationError:
            pass
        if not text:
            raise argparse.ArgumentTypeError(f"{noun} must not be empty")
        if meta.max_length is not None and len(text) > meta.max_length:
            raise argparse.ArgumentTypeError(f"{noun} must be at most {meta.max_length} characters, got {len(text)}")
        bad = next((c for c in text if not re.fullmatch(meta.pattern, c)), None)
        what = f"may not contain {_char(bad)}" if bad else f"must match {meta.pattern}"
        raise argparse.ArgumentTypeError(f"{noun} {what}, got {printable(text)!r}{hint}")

    return check


task_id = _text(p.TaskId, "a task id")
task_type = _text(p.TaskType, "a task type")
tenant = _text(p.Name, "a tenant name")


def _ref(limit: Any, what: str, names: Callable[[str], bool] = lambda name: True) -> Callable[[str], int | str]:
    """An argparse type for a number or a name (a GPU, a client), held to the protocol's type;
    ``names``: whether a name can name one at all."""

    def check(text: str) -> int | str:
        try:
            ref: int | str | None = msgspec.convert(gpu_ref(text), limit)
        except msgspec.ValidationError:
            ref = None
        if ref is None or isinstance(ref, str) and not names(ref):
            raise argparse.ArgumentTypeError(f"must be {what}, got {printable(text)!r}")
        return ref

    return check


def _names_a_gpu(name: str) -> bool:
    """``gpu:N`` with N an index, or a UUID as NVML gives it (``GPU-…``, ``MIG-…``; gpud compares them
    without case): anything else (``-1``, ``cuda0``) could never name a GPU, so it is bad usage, not a
    question for gpud."""
    if name.startswith("gpu:"):
        return re.fullmatch(r"gpu:\d+", name, re.ASCII) is not None and int(name[4:]) < p.MAX_GPUS
    return name.lower().startswith(("gpu-", "mig-")) and len(name) > 4


gpu_arg = _ref(p.GpuRef, f"a GPU index 0..{p.MAX_GPUS - 1}, gpu:N or a GPU's UUID", _names_a_gpu)
client_arg = _ref(p.ClientRef, "a client id (1 or more) or a client name (printable)")


def prefer_arg(text: str) -> list[int | str]:
    return [gpu_arg(x) for x in text.split(",")]


def size_arg(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} is negative, and negative sizes are not allowed (0 lifts the limit)"
        )
    try:
        size: int = msgspec.convert(parse_bytes(text), p.Bytes)
    except msgspec.ValidationError:  # a ValueError too: first
        raise argparse.ArgumentTypeError(f"must be {bounds(p.Bytes)} bytes, got {text}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return size


def count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"seconds must be > 0 and <= 86400, got {text}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing and exiting, so main answers it (in
    JSON with --json); it takes '-1GiB' or '-3' as a value, so that value's check names it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage(), self.prog)
