"""A Python call as the program of a run (``gpud-run``): how the Ray and Airflow integrations pause a task.

The caller holds a fractional allocation. ``call_under_run`` pickles the callable and its
arguments into a private directory, runs ``python -m gpud_client.run.pycall DIR`` as the
program of a run whose session belongs to that allocation (``--gpu G --task ID``: its share
caps it), supervises that run from the calling thread (``run_program`` without taking
signal handlers) and returns what the callable returned, or raises what it raised. The
child's whole process tree runs only while the session holds the lock, so the callable
needs no slices. ``Place.command`` gives the same run around any command line (the Airflow
mixin's BashOperator).

The pickler is the caller's (``ray.cloudpickle`` in a Ray worker, ``dill`` in Airflow),
named on the call and imported only then, on both sides: the base client imports none of
them. The child takes this process's ``sys.path``, and can import the modules this process
loaded from a file under a name that no path entry has (Airflow loads DAG files so), so
what was pickled by reference unpickles there.

What it must never do: leave the directory behind, or pass over a child that ended
without a result (killed, refused by gpud, a result that cannot be pickled): that is
``CallFailed``, with the status and what the run said.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from gpud_client.run import parse, run_program
from gpud_client.run.options import PAUSE_BACKENDS

__all__ = ["PICKLERS", "CallFailed", "Pause", "Place", "call_under_run", "check_pause"]

PROG = "gpud-run"
Pause = Literal["auto", "cuda", "signal", "cgroup"]  # gpud-run --pause
Pickler = Literal["pickle", "dill", "ray.cloudpickle"]
PICKLERS: tuple[Pickler, ...] = ("pickle", "dill", "ray.cloudpickle")  # the child imports nothing else
CALL, RESULT = "call", "result"
_DUMPS: dict[str, dict[str, Any]] = {"dill": {"recurse": True}}  # a function's globals: those it uses


class CallFailed(RuntimeError):
    """The call's child process ended without a result: ``status`` is its exit status (or the run's own:
    1 when gpud refused the run), and the message ends with what the run said."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray and the child as itself, status included
        return (type(self), (str(self), self.status))


def check_pause(pause: object, where: str, *, gpus: float | None = None, slices: str = "body") -> None:
    """``pause`` is None (not paused) or a backend of ``gpud-run --pause``, for a fraction of a GPU
    (``gpus``, when known) and a whole body (``slices``); ValueError naming ``where``."""
    if pause is None:
        return
    if pause not in PAUSE_BACKENDS:
        choices = ", ".join(repr(b) for b in PAUSE_BACKENDS)
        raise ValueError(f"{where}: pause must be one of {choices} (or None: not paused), not {pause!r}")
    if gpus is not None and gpus >= 1:
        raise ValueError(
            f"{where}: pause= keeps a task to a fraction of one GPU; with whole GPUs (gpus={gpus:g}) the "
            "task has them to itself and is never paused: leave pause out"
        )
    if slices != "body":
        raise ValueError(
            f"{where}: pause= runs the whole body in a child process that gpud pauses between turns; "
            f"slices={slices!r} does not go with it (gpud_slice() has no session there)"
        )


@dataclass(frozen=True, kw_only=True)
class Place:
    """A run's session on GPU ``gpu`` that belongs to the fractional allocation ``task_id`` the caller
    holds: the share caps its limits, and the caller frees the allocation, not the run."""

    socket: str
    gpu: int
    task_id: str
    pause: Pause = "auto"
    name: str | None = None  # what gpuctl clients shows (default run:PROGRAM)
    mem_limit: int | None = None  # bytes, under the share's
    mem_estimate: int | None = None  # bytes admission counts
    priority: int | None = None

    def flags(self) -> list[str]:
        flags = ["--socket", self.socket, "--gpu", str(self.gpu), "--task", self.task_id, "--pause", self.pause]
        optional = {
            "--name": self.name,
            "--mem-limit": self.mem_limit,
            "--mem-estimate": self.mem_estimate,
            "--priority": self.priority,
        }
        for flag, value in optional.items():
            if value is not None:
                flags += [flag, str(value)]
        return flags

    def command(self, program: Sequence[str]) -> list[str]:
        """``program`` as the program of a run in this place: ``python -m gpud_client.run FLAGS -- PROGRAM``."""
        return [sys.executable, "-m", "gpud_client.run", *self.flags(), "--", *program]

    @contextmanager
    def commands_of(self, hook: Any) -> Iterator[None]:
        """While it lasts, the commands ``hook.run_command`` runs (Airflow's SubprocessHook: BashOperator's
        ``bash -c ...``) run as programs of runs in this place; their output and exit status go as before."""
        run_command = hook.run_command

        def under_run(command: list[str], *args: Any, **kwargs: Any) -> Any:
            return run_command(self.command(command), *args, **kwargs)

        hook.run_command = under_run
        try:
            yield
        finally:
            del hook.run_command


@dataclass(frozen=True)
class _Call:
    """What the child is given, with plain pickle: where to import from, then the pickled call."""

    path: list[str]
    files: dict[str, str]  # module name -> the file it was loaded from
    env: dict[str, str]  # set before anything is unpickled
    pickler: Pickler
    payload: bytes


# --- the caller's side ---------------------------------------------------------------------------


def call_under_run(
    place: Place,
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    pickler: Pickler,
    env: Mapping[str, str] | None = None,
) -> Any:
    """``func(*args, **kwargs)`` in a child process, run under gpud in ``place``: its result, or its
    exception raised here (a note carries the child's traceback); ``CallFailed`` when the child ended
    without either. ``env``: set in the child before it unpickles anything. Blocks the calling thread
    until the child ends."""
    codec = _pickler(pickler)
    payload = codec.dumps((func, tuple(args), dict(kwargs or {})), **_DUMPS.get(pickler, {}))
    call = _Call(list(sys.path), _loaded_from_files(), dict(env or {}), pickler, payload)
    with tempfile.TemporaryDirectory(prefix="gpud-call-") as directory:
        with open(os.path.join(directory, CALL), "wb") as f:
            pickle.dump(call, f)
        opts = parse([*place.flags(), "--", sys.executable, "-m", __name__, directory], PROG)
        said = _Said()
        status = run_program(opts, prog=PROG, err=said, forward_signals=False)
        try:
            with open(os.path.join(directory, RESULT), "rb") as f:
                outcome = f.read()
        except FileNotFoundError:
            last = said.getvalue().strip().splitlines()[-1:]
            raise CallFailed(
                f"the call's child process ended with status {status} and no result" + "".join(f": {x}" for x in last),
                status,
            ) from None
    kind, value = codec.loads(outcome)
    if kind == "raised":
        raise value
    return value


class _Said(io.StringIO):
    """What the run says, kept for CallFailed's message and passed on to stderr."""

    def write(self, s: str) -> int:
        sys.stderr.write(s)
        return super().write(s)


def _pickler(name: str) -> ModuleType:
    if name not in PICKLERS:
        raise ValueError(f"pickler must be one of {', '.join(PICKLERS)}, not {name!r}")
    return importlib.import_module(name)


def _loaded_from_files() -> dict[str, str]:
    """Top-level modules loaded from a file that no ``sys.path`` entry finds under their name (a DAG
    file as Airflow imports it): the child loads them from the same file if it needs them."""
    found = {}
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if "." in name or name in ("__main__", "__mp_main__") or spec is None or not spec.has_location:
            continue
        if spec.origin and importlib.machinery.PathFinder.find_spec(name, sys.path) is None:
            found[name] = spec.origin
    return found


# --- the child's side ----------------------------------------------------------------------------


class _FromFiles(importlib.abc.MetaPathFinder):
    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        origin = self.files.get(name)
        return importlib.util.spec_from_file_location(name, origin) if origin else None


def main(argv: Sequence[str]) -> int:
    """The child: load the call from ``argv[0]``, make it, write its outcome there."""
    (directory,) = argv
    with open(os.path.join(directory, CALL), "rb") as f:
        call: _Call = pickle.load(f)
    os.environ.update(call.env)
    sys.path[:] = call.path
    sys.meta_path.append(_FromFiles(call.files))
    codec = _pickler(call.pickler)
    outcome: tuple[str, Any]
    try:
        func, args, kwargs = codec.loads(call.payload)
        outcome = ("returned", func(*args, **kwargs))
    except BaseException as exc:  # the caller raises it as its own, SystemExit included
        exc.add_note(
            "in the child process that gpud paused between turns:\n" + "".join(traceback.format_exception(exc))
        )
        outcome = ("raised", exc)
    try:
        data = codec.dumps(outcome)
    except Exception as exc:
        what = "result" if outcome[0] == "returned" else "exception"
        told = "\n" + "".join(traceback.format_exception(outcome[1])) if outcome[0] == "raised" else ""
        data = codec.dumps(("raised", CallFailed(f"the call's {what} could not be pickled back: {exc!r}" + told, 0)))
    partial = os.path.join(directory, RESULT + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, os.path.join(directory, RESULT))  # whole or not at all: a killed child leaves none
    return 0


if __name__ == "__main__":  # run as __main__: what it pickles must name the module by its own name
    from gpud_client.run.pycall import main as _main

    sys.exit(_main(sys.argv[1:]))
