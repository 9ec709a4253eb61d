"""The escape rules of a run (``RunCore.escaped``) and how the ``cgroup`` backend composes, with fakes.

No process, socket or clock: the core on injected time, the backend with a recording freezer and a
recording inner backend (the CUDA driver's stand-in) and fallback (SIGSTOP's).
"""

from __future__ import annotations

import pytest

from gpud_client.core.run import CONTROL_FAILED, EndProgram, Exit, Pause, ReportEscape, RunCore, Say
from gpud_client.core.run_state import Ended, Normal
from gpud_client.proctl.base import ControlError, Paused
from gpud_client.proctl.cgroup import CgroupBackend, FreezerAway
from gpud_client.proctl.signals import SignalBackend
from gpud_client.proctl.tree import ProcessTree


def paused(**kw: int) -> RunCore:
    core = RunCore(**kw)  # type: ignore[arg-type]
    core.begin(0.0)
    core.granted(0.0)
    actions = core.dropped(1.0)
    assert isinstance(actions[0], Pause) and core.state == Normal("paused")
    return core


# --- the rules ---------------------------------------------------------------------------------------


def test_each_escape_is_counted_reported_and_said() -> None:
    core = paused(max_escapes=3)
    first = core.escaped(41, "it was running (state R) while paused")
    assert first[0] == ReportEscape(41, 1)
    assert isinstance(first[1], Say) and "escape 1 of 3" in first[1].text and "41" in first[1].text
    assert core.escaped(42, "it used 30 ms of CPU time while paused")[0] == ReportEscape(42, 2)
    assert core.state == Normal("paused") and core.escapes == 2


def test_the_max_escapes_th_ends_the_program_as_a_failed_pause_does() -> None:
    core = paused(max_escapes=2)
    core.escaped(41, "state R")
    last = core.escaped(41, "state R")
    assert last[0] == ReportEscape(41, 2)
    assert isinstance(last[1], EndProgram) and "--max-escapes 2 ends it" in last[1].why
    assert isinstance(last[2], Exit) and last[2].status == CONTROL_FAILED
    assert core.state == Ended() and core.escaped(41, "state R") == []  # nothing after the end


def test_max_escapes_zero_never_ends_it() -> None:
    core = paused(max_escapes=0)
    for n in range(1, 50):
        actions = core.escaped(7, "state R")
        assert actions[0] == ReportEscape(7, n) and isinstance(actions[1], Say) and f"(escape {n})" in actions[1].text
    assert core.state == Normal("paused")


def test_an_escape_that_could_not_be_stopped_again_ends_it_at_once() -> None:
    core = paused(max_escapes=0)
    actions = core.escaped(9, "state R, and could not be stopped again", fatal=True)
    assert actions[0] == ReportEscape(9, 1) and isinstance(actions[1], EndProgram) and core.state == Ended()


# --- the cgroup backend's order ------------------------------------------------------------------------


class Log:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.away = False  # the freezer cannot be reached


class FakeFreezer:
    def __init__(self, log: Log) -> None:
        self.log = log

    def freeze(self) -> None:
        if self.log.away:
            raise FreezerAway("gpud is away")
        self.log.calls.append("freeze")

    def thaw(self) -> None:
        if self.log.away:
            raise FreezerAway("gpud is away")
        self.log.calls.append("thaw")


class FakeCuda:
    name = "cuda"
    can_park = True

    def __init__(self, log: Log, refuse_resume: bool = False) -> None:
        self.log = log
        self.refuse_resume = refuse_resume

    def pause(self, tree: ProcessTree) -> Paused:
        self.log.calls.append("lock")
        return Paused(locked=[1])

    def resume(self, tree: ProcessTree) -> None:
        self.log.calls.append("unlock")
        if self.refuse_resume:
            raise ControlError("no room on the GPU")

    def park(self, tree: ProcessTree) -> int:
        self.log.calls.append("checkpoint")
        return 10

    def close(self) -> None:
        self.log.calls.append("close")


class FakeSignals(SignalBackend):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def pause(self, tree: ProcessTree) -> Paused:
        self.log.calls.append("sigstop")
        return Paused(stopped=[2])

    def resume(self, tree: ProcessTree) -> None:
        self.log.calls.append("sigcont")


def backend(log: Log, **kw: bool) -> CgroupBackend:
    return CgroupBackend(FakeFreezer(log), inner=FakeCuda(log, **kw), fallback=FakeSignals(log))


TREE = ProcessTree(1)


def test_a_pause_locks_then_freezes_and_a_resume_thaws_then_unlocks() -> None:
    log = Log()
    b = backend(log)
    assert b.name == "cuda+cgroup" and b.can_park
    b.pause(TREE)
    b.resume(TREE)
    assert log.calls == ["lock", "freeze", "thaw", "unlock"]


def test_a_park_thaws_around_the_checkpoint_the_driver_cannot_make_on_a_frozen_process() -> None:
    log = Log()
    b = backend(log)
    b.pause(TREE)
    assert b.park(TREE) == 10
    assert log.calls == ["lock", "freeze", "thaw", "checkpoint", "freeze"]


def test_gpud_away_stops_the_tree_with_sigstop_until_the_resume() -> None:
    log = Log()
    b = backend(log)
    log.away = True
    done = b.pause(TREE)
    assert done.stopped == [2] and "stopped with SIGSTOP" in done.fallbacks[0]
    with pytest.raises(ControlError, match="cannot be checkpointed"):
        b.park(TREE)  # a stopped process cannot be
    log.away = False
    b.resume(TREE)
    assert log.calls == ["lock", "sigstop", "sigcont", "unlock"]  # nothing to thaw: it was never frozen


def test_a_thaw_gpud_cannot_make_refuses_the_resume_without_ending_the_program() -> None:
    log = Log()
    b = backend(log)
    b.pause(TREE)
    log.away = True
    with pytest.raises(FreezerAway) as refused:
        b.resume(TREE)
    assert not refused.value.fatal and log.calls == ["lock", "freeze"]


def test_a_resume_the_gpu_work_refuses_leaves_the_program_frozen_again() -> None:
    log = Log()
    b = backend(log, refuse_resume=True)
    b.pause(TREE)
    with pytest.raises(ControlError, match="no room"):
        b.resume(TREE)
    assert log.calls == ["lock", "freeze", "thaw", "unlock", "freeze"]


def test_without_gpu_work_the_cgroup_alone_pauses() -> None:
    log = Log()
    b = CgroupBackend(FakeFreezer(log), fallback=FakeSignals(log))
    assert b.name == "cgroup" and not b.can_park
    b.pause(TREE)
    b.resume(TREE)
    assert log.calls == ["freeze", "thaw"]
    with pytest.raises(ControlError, match="cannot park"):
        b.park(TREE)
