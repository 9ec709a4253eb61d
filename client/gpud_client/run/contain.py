"""A run's program, handed to gpud: CONTAIN, the freezer of the ``cgroup`` backend, ESCAPED reports.

The run hands gpud its program's pid before the program execs (the keeper holds it), asking for a
cgroup under ``--pause auto`` and ``cgroup``. gpud checks the pid against the kernel (the run's own
descendant, of its uid) and answers whether the program now lives in a cgroup of gpud's: then the
run pauses it through gpud (FREEZE, THAW: ``proctl.cgroup.CgroupBackend``); else it stops it itself
(``signal``, watched for escapes), and gpud only watches what the kernel says of it.

``Containment`` is also that backend's ``Freezer``. Here gpud away (a restart) is ``FreezerAway``, so
the backend stops the tree with SIGSTOP meanwhile; a FREEZE or THAW refused because gpud no longer
knows the program (it restarted and nobody claimed it yet) CONTAINs it again and asks once more: gpud
claims it as the kernel left it. Nothing here decides when to pause: ``RunCore`` does.
"""

from __future__ import annotations

from collections.abc import Callable

from gpud_client import protocol as p
from gpud_client.client import Client
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.proctl.base import Backend, ControlError
from gpud_client.proctl.cgroup import CgroupBackend, FreezerAway
from gpud_client.proctl.signals import Escape, SignalBackend
from gpud_client.run.options import RunOptions


class NoCgroup(Exception):
    """``--pause cgroup`` and gpud has no cgroup for the program; the message says why."""


class Containment:
    def __init__(self, client: Client, pid: int, *, pause: str, cgroup: bool) -> None:
        self.client = client
        self.pid = pid
        self.pause = pause  # the run's own process control beside the cgroup, for gpuctl
        self.cgroup = cgroup  # asked for
        self.contained: p.Contained | None = None
        self.why = ""  # why the program has no cgroup

    @property
    def in_cgroup(self) -> bool:
        return self.contained is not None and self.contained.backend == "cgroup"

    def contain(self, pid: int | None = None) -> p.Contained | None:
        """CONTAIN the program (a new one: ``pid``); None when gpud refused or is away (``why`` says)."""
        self.pid = pid or self.pid
        msg = p.Contain(id=0, pid=self.pid, cgroup=self.cgroup, pause=self.pause)
        try:
            self.contained = self.client.call(msg)
        except GpudError as exc:
            self.contained, self.why = None, f"gpud did not take the program: {exc}"
            return None
        assert self.contained is not None
        self.why = self.contained.why
        return self.contained

    def freeze(self) -> None:
        if not self._state(p.Freeze(id=0)):
            raise ControlError("gpud could not freeze the program's cgroup in time; it may still run", fatal=True)

    def thaw(self) -> None:
        self._state(p.Thaw(id=0))

    def escaped(self, pid: int, escapes: int) -> None:
        """Tell gpud (gpuctl clients, its metric); best effort: a run that cannot tell goes on."""
        try:
            self.client.call(p.Escaped(id=0, pid=pid, escapes=escapes))
        except GpudError:
            pass

    def _state(self, msg: p.Freeze | p.Thaw) -> bool:
        for again in (False, True):
            try:
                reply: p.ProgramState = self.client.call(msg)
                return reply.frozen
            except DaemonUnavailable as exc:
                raise FreezerAway(str(exc)) from None
            except ProtocolError as exc:
                if again or exc.code != p.ErrorCode.INVALID or self.contain() is None or not self.in_cgroup:
                    raise ControlError(f"gpud refused to {type(msg).__name__.lower()} the program: {exc}") from exc
        raise AssertionError("unreachable")


def contain(
    client: Client,
    opts: RunOptions,
    pid: int,
    inner: Backend | None,
    on_escape: Callable[[Escape], None],
) -> tuple[Backend | None, Containment]:
    """Hand the program to gpud; the backend that pauses it: gpud's cgroup (with ``inner`` when it acts
    on the GPU work, the CUDA driver's), or ``inner`` as it is. Raises NoCgroup for ``--pause cgroup``
    without one."""
    want = opts.pause in ("auto", "cgroup")
    c = Containment(client, pid, pause=inner.name if inner is not None else "none", cgroup=want)
    c.contain()
    if not c.in_cgroup:
        if opts.pause == "cgroup":
            raise NoCgroup(f"--pause cgroup: gpud has no cgroup for the program: {c.why or 'not offered'}")
        return inner, c
    if inner is None:
        return None, c  # never paused (whole GPUs): the cgroup still ends it whole with its run
    if isinstance(inner, SignalBackend):  # the cgroup replaces SIGSTOP; the CUDA driver's lock stays beside it
        inner.close()
        inner = None
    return CgroupBackend(c, inner=inner, fallback=SignalBackend(on_escape=on_escape)), c
