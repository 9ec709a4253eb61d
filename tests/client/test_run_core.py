"""The rules of a run (``gpud_client.core.run``) on injected time: no process, no socket, no sleep."""

from __future__ import annotations

import signal

import pytest

from gpud_client.core.run import (
    CONTROL_FAILED,
    AnswerPark,
    EndProgram,
    Exit,
    Forward,
    Park,
    Pause,
    Release,
    Request,
    Resume,
    RunCore,
    Start,
)

TERM = int(signal.SIGTERM)


def running(**kw: object) -> RunCore:
    core = RunCore(**kw)  # type: ignore[arg-type]
    assert core.begin(0.0) == [Request()]
    assert core.granted(0.0) == [Start()]
    return core


def test_the_program_starts_only_at_the_first_grant() -> None:
    core = RunCore()
    assert core.begin(0.0) == [Request()]
    assert core.state == "starting"
    assert core.granted(1.0) == [Start()]
    assert core.state == "running"


def test_a_whole_gpu_starts_at_once_and_is_never_paused() -> None:
    core = RunCore(arbitrated=False, idle_release=0.1)
    assert core.begin(0.0) == [Start()]
    assert core.tick(10.0, 0.0) == []  # never idle-released: nothing to give back


def test_a_drop_pauses_releases_and_asks_again_then_a_grant_resumes() -> None:
    core = running()
    actions = core.dropped(1.0)
    assert [type(a) for a in actions] == [Pause, Release, Request]
    assert core.state == "paused" and not core.holding
    assert core.dropped(1.1) == []  # a late second drop changes nothing
    assert core.granted(2.0) == [Resume()]
    assert core.state == "running"


def test_a_lost_lock_pauses_and_ends_the_open_slice_before_asking_again() -> None:
    core = running()
    assert [type(a) for a in core.lost(1.0)] == [Pause, Release, Request]
    assert core.lost(1.1) == []


def test_an_idle_program_gives_the_lock_back_after_idle_release() -> None:
    core = running(idle_release=1.0)
    assert core.tick(0.1, 2.0) == []  # the first look: what activity is measured from
    assert core.tick(0.5, 3.0) == []  # its activity moved: active
    assert core.next_tick(0.5, 0.1) == pytest.approx(0.6)
    assert core.tick(1.4, 3.0) == []  # 0.9 s without activity
    assert core.next_tick(1.4, 0.1) == pytest.approx(1.5)  # looked at exactly when it would be idle
    actions = core.tick(1.5, 3.0)
    assert [type(a) for a in actions] == [Pause, Release, Request]
    assert core.idle_releases == 1


def test_the_first_look_after_a_grant_is_not_activity() -> None:
    """The idle clock starts at the grant: a turn lasts idle_release, not that and a tick more."""
    core = running(idle_release=1.0)
    assert core.tick(0.1, 5.0) == []
    assert [type(a) for a in core.tick(1.0, 5.0)] == [Pause, Release, Request]


def test_an_active_program_is_never_idle_released() -> None:
    core = running(idle_release=1.0)
    for i in range(1, 50):
        assert core.tick(i * 0.5, float(i)) == []


def test_park_is_done_only_for_a_started_paused_program_with_a_backend_that_can() -> None:
    assert RunCore(can_park=True).park_asked() == [AnswerPark(True)]  # not started: nothing on the GPU
    core = running(can_park=True)
    assert core.park_asked() == [AnswerPark(False, "the program holds the GPU again")]
    core.dropped(1.0)
    assert core.park_asked() == [Park()]
    assert core.park_asked() == []  # one park at a time
    assert core.park_done(True, "1 bytes") == [AnswerPark(True, "1 bytes")]
    assert core.state == "parked"
    assert core.park_asked() == [AnswerPark(True)]  # already parked
    assert core.granted(2.0) == [Resume()]  # the driver restores before it resumes


def test_a_backend_that_cannot_park_says_so() -> None:
    core = running()
    core.dropped(1.0)
    assert core.park_asked() == [AnswerPark(False, "this run's backend cannot park GPU memory (signal)")]


def test_a_refused_resume_gives_the_turn_back_and_stays_parked() -> None:
    core = running(can_park=True)
    core.dropped(1.0)
    core.park_asked()
    core.park_done(True)
    core.granted(2.0)
    assert core.resume_refused() == [Release(), Request()]
    assert core.state == "parked" and core.parked and not core.holding


def test_a_signal_to_a_paused_program_resumes_it_for_the_grace_then_pauses_it_again() -> None:
    core = running(signal_grace=2.0)
    core.dropped(1.0)
    assert core.signalled(TERM, 3.0) == [Resume(), Forward(TERM)]
    assert core.state == "running" and not core.holding
    assert core.next_tick(3.0, 10.0) == 5.0
    actions = core.tick(5.0, None)
    assert [type(a) for a in actions] == [Pause]
    assert core.state == "paused"


def test_a_grant_during_the_grace_keeps_the_program_running() -> None:
    core = running(signal_grace=2.0)
    core.dropped(1.0)
    core.signalled(TERM, 3.0)
    assert core.granted(4.0) == []  # already running: now arbitrated again
    assert core.tick(5.0, None) == []


def test_a_signal_to_a_running_or_parked_program_is_forwarded_as_it_is() -> None:
    core = running(can_park=True)
    assert core.signalled(TERM, 1.0) == [Forward(TERM)]
    core.dropped(1.0)
    core.park_asked()
    core.park_done(True)
    assert core.signalled(TERM, 2.0) == [Forward(TERM)]  # its CPU side runs under the driver's lock


def test_a_signal_before_the_program_started_ends_the_run() -> None:
    core = RunCore()
    core.begin(0.0)
    assert core.signalled(TERM, 1.0) == [Exit(128 + TERM, f"signal {TERM} before the program started")]
    assert core.granted(2.0) == []  # a grant that comes after changes nothing


def test_the_run_ends_with_the_programs_status_or_ends_the_program_on_a_control_failure() -> None:
    assert running().exited(7) == [Exit(7)]
    core = running()
    why = "the driver did not answer"
    assert core.failed(why) == [EndProgram(why), Exit(CONTROL_FAILED, why)]
    assert core.failed(why) == []
