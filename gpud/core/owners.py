"""Which process a caller may name: an allocation's owner, a run's program.

gpud signals, pauses and reaps the processes clients name, so a pid a client sends is a claim,
checked against what the kernel says of that process (read by the shell from /proc and held by
pidfd). Rules kept here:
- Never pid 1 (or 0), never the daemon itself, never a kernel thread: not even for an admin.
- A process the caller could signal itself, as kill(2) judges it: the caller's uid is the
  target's real or saved uid. Root is no exception here: naming another uid's process takes
  the explicit, logged ``any_uid`` option, for admins only.
- A process of the caller's own lineage: the caller, one of its ancestors of the same uid (the
  shell that started it), or a descendant of one of those (a sibling, a child). Another login
  session of the same user is not named by mistake.
- Where the shell cannot read the target's credentials (``/proc`` hidden from the daemon), only
  the connecting process itself may be named: the kernel vouched for it through SO_PEERCRED.
- A run's program must be the run's own descendant (``check_program``).

Pure functions over plain data; they refuse with a named error and change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpud.core.errors import Refused
from gpud_client.protocol import ErrorCode


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """One process as /proc showed it. ``start`` (clock ticks after boot) with ``pid`` names one
    process for good: a reused pid has a later start."""

    pid: int
    ppid: int
    ruid: int
    euid: int
    suid: int
    start: int
    kthread: bool


@dataclass(frozen=True, slots=True)
class Caller:
    """The connecting process, as SO_PEERCRED gave it, and its lineage: itself and its ancestors
    of its own uid, nearest first (just itself when /proc hides the rest)."""

    pid: int
    uid: int
    lineage: tuple[int, ...]


def _refuse(message: str) -> Refused:
    return Refused(ErrorCode.PERMISSION_DENIED, message)


def check_never(pid: int, facts: ProcessFacts | None, *, daemon_pid: int, what: str) -> None:
    """What nobody may name, an admin neither."""
    if pid <= 1:
        raise _refuse(f"{what} {pid} is init: gpud never signals or pauses it")
    if pid == daemon_pid:
        raise _refuse(f"{what} {pid} is gpud itself")
    if facts is not None and facts.kthread:
        raise _refuse(f"{what} {pid} is a kernel thread")


def check_owner(
    pid: int,
    facts: ProcessFacts | None,
    ancestry: Sequence[int],
    caller: Caller,
    *,
    daemon_pid: int,
    any_uid: bool = False,
) -> None:
    """Refuse ``pid`` as an owner ``caller`` may name (``ancestry``: the target and its ancestors,
    nearest first, as /proc shows them; ``any_uid``: an admin's explicit option, already checked)."""
    what = "owner pid"
    check_never(pid, facts, daemon_pid=daemon_pid, what=what)
    if facts is None:
        if pid == caller.pid:
            return
        raise _refuse(
            f"{what} {pid}: gpud cannot read that process's credentials (no such process, or /proc "
            f"hidden from the daemon), so only the connecting process itself ({caller.pid}) may be named"
        )
    if any_uid:
        return
    if caller.uid not in (facts.ruid, facts.suid):
        raise _refuse(
            f"{what} {pid} belongs to uid {facts.ruid}, not to you (uid {caller.uid}): you could not signal it "
            "yourself (an admin may, with owner_any_uid)"
        )
    if pid in caller.lineage or any(a in caller.lineage for a in ancestry):
        return
    raise _refuse(
        f"{what} {pid} is not yours to name: it is neither your process ({caller.pid}), the shell that started "
        "it, nor a descendant of either"
    )


def check_program(
    pid: int, facts: ProcessFacts | None, ancestry: Sequence[int], caller: Caller, *, daemon_pid: int
) -> None:
    """Refuse ``pid`` as the program of the run ``caller``: it must be the run's own descendant, of
    the run's uid, as the kernel says."""
    what = "program pid"
    check_never(pid, facts, daemon_pid=daemon_pid, what=what)
    if facts is None:
        raise _refuse(f"{what} {pid}: gpud cannot read that process (no such process, or /proc hidden from the daemon)")
    if caller.uid not in (facts.ruid, facts.suid):
        raise _refuse(f"{what} {pid} belongs to uid {facts.ruid}, not to the run's uid {caller.uid}")
    if pid == caller.pid or caller.pid not in ancestry:
        raise _refuse(f"{what} {pid} is not a descendant of the run ({caller.pid})")
