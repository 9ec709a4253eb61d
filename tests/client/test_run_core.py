"""The rules of a run (``gpud_client.core.run``) on injected time: no process, no socket, no sleep."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from typing import get_args

import pytest

from gpud_client import protocol as p
from gpud_client.core.recovery import without
from gpud_client.core.run import (
    CONTROL_FAILED,
    PREEMPTED,
    Allocate,
    AnswerPark,
    EndProgram,
    Exit,
    Forward,
    Park,
    Pause,
    Release,
    Request,
    Resume,
    RunAction,
    RunCore,
    RunShown,
    Say,
    Start,
    UseAllocation,
    Yield,
)
from gpud_client.core.run_events import Changed, Preempted, Revoked, Withdrawn, pushed
from gpud_client.core.run_state import Ended, Ending, Normal, Suspended, Waiting

TERM = int(signal.SIGTERM)


def running(**kw: object) -> RunCore:
    core = RunCore(**kw)  # type: ignore[arg-type]
    assert core.begin(0.0) == [Request()]
    assert core.granted(0.0) == [Start()]
    return core


def test_the_program_starts_only_at_the_first_grant() -> None:
    core = RunCore()
    assert core.begin(0.0) == [Request()]
    assert core.state == Normal("starting")
    assert core.granted(1.0) == [Start()]
    assert core.state == Normal("running")


def test_a_whole_gpu_starts_at_once_and_is_never_paused() -> None:
    core = RunCore(arbitrated=False, idle_release=0.1)
    assert core.begin(0.0) == [Start()]
    assert core.tick(10.0, 0.0) == []  # never idle-released: nothing to give back


def test_a_drop_pauses_releases_and_asks_again_then_a_grant_resumes() -> None:
    core = running()
    actions = core.dropped(1.0)
    assert [type(a) for a in actions] == [Pause, Release, Request]
    assert core.state == Normal("paused") and not core.run.holding
    assert core.dropped(1.1) == []  # a late second drop changes nothing
    assert core.granted(2.0) == [Resume()]
    assert core.state == Normal("running")


def test_a_lost_lock_pauses_and_ends_the_open_slice_before_asking_again() -> None:
    core = running()
    assert [type(a) for a in core.lost(1.0)] == [Pause, Say, Release, Request]
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
    assert core.state == Normal("parked")
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
    assert core.resume_refused("no room") == [
        Say("could not resume the program yet: no room; giving the turn back"),
        Release(),
        Request(),
    ]
    assert core.state == Normal("parked") and not core.run.holding


def test_a_refused_resume_of_a_whole_gpu_run_ends_its_program_rather_than_ask_for_a_lock() -> None:
    """Whole GPUs hold no session: asking for the lock again crashed the run; the program is ended
    (never left paused for good), as when process control fails."""
    core = whole(recovery="suspend")
    core.preempted(notice(p.Recovery.SUSPEND), 1.0)
    assert core.changed(changed("resumed", alloc()), 2.0)[1:] == [Resume()]
    actions = core.resume_refused("no room for the parked memory")
    assert Release() not in actions and Request() not in actions
    assert kinds(actions) == [EndProgram, Exit] and "no room for the parked memory" in actions[0].why


def test_a_signal_to_a_paused_program_resumes_it_for_the_grace_then_pauses_it_again() -> None:
    core = running(signal_grace=2.0)
    core.dropped(1.0)
    assert core.signalled(TERM, 3.0) == [Resume(), Forward(TERM)]
    assert core.state == Normal("running") and not core.run.holding
    assert core.next_tick(3.0, 10.0) == 5.0
    actions = core.tick(5.0, None)
    assert [type(a) for a in actions] == [Pause]
    assert core.state == Normal("paused")


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


# --- when gpud takes the allocation back (core/recovery.py) -------------------------------------

KILL, USR1 = int(signal.SIGKILL), int(signal.SIGUSR1)


def alloc(gpus: list[int] | None = None, *, resume: bool = False, share: float = 1.0) -> p.Allocated:
    gpus = [0] if gpus is None else gpus
    return p.Allocated(
        id=0,
        task_id="job",
        gpus=gpus,
        uuids=[f"GPU-{g}" for g in gpus],
        share=share,
        cpus=[],
        cuda_visible_devices=",".join(map(str, gpus)),
        tenant=None,
        priority=10,
        owner_pid=None,
        resume=resume,
    )


def notice(
    recovery: p.Recovery = p.Recovery.TERMINATE, *, whole: bool = True, gpus: list[int] | None = None, grace: float = 10
) -> p.Preempt:
    return p.Preempt(
        task_id="job",
        reason=p.PreemptReason.ELASTIC if not whole else p.PreemptReason.PRIORITY,
        recovery=recovery,
        gpus=[0] if gpus is None else gpus,
        whole=whole,
        grace_s=grace,
        by="urgent",
    )


def revoked(gone: bool = True, state: p.AllocState = p.AllocState.RUNNING) -> p.AllocRevoked:
    return p.AllocRevoked(task_id="job", reason=p.PreemptReason.PRIORITY, state=state, gone=gone)


def changed(change: str, allocation: p.Allocated) -> p.AllocChanged:
    return p.AllocChanged(change=change, allocation=allocation)


def whole(allocation: p.Allocated | None = None, **kw: object) -> RunCore:
    """A run on whole GPUs (no lock), its program started."""
    core = RunCore(arbitrated=False, **kw)  # type: ignore[arg-type]
    core.use_allocation(allocation or alloc())
    assert core.begin(0.0) == [Start()]
    return core


def fraction(**kw: object) -> RunCore:
    """A run on a fraction of one GPU, its program started at its first grant."""
    core = running(**kw)
    core.use_allocation(alloc(share=0.5))
    return core


def ending(core: RunCore) -> Ending:
    assert isinstance(core.state, Ending)
    return core.state


def kinds(actions: list[RunAction]) -> list[type]:
    return [type(a) for a in actions]


def said(actions: list[RunAction]) -> str:
    return " / ".join(a.text for a in actions if isinstance(a, Say))


def test_terminate_sends_sigterm_at_once_and_sigkill_half_a_second_before_the_daemons_grace_ends() -> None:
    core = whole()
    actions = core.preempted(notice(grace=10), 1.0)
    assert actions[1:] == [Forward(TERM)] and "task job was preempted by urgent (priority)" in said(actions)
    assert core.next_tick(1.0, 100.0) == pytest.approx(10.5)
    assert core.tick(10.4, None) == []
    actions = core.tick(10.5, None)
    assert actions[-1] == Forward(KILL) and "did not end within 10 s" in said(actions)
    assert core.tick(11.0, None) == []  # killed once
    assert core.exited(128 + KILL) == [Exit(128 + KILL)]  # the program's own status


def test_terminate_of_a_program_that_ends_in_time_exits_with_its_status_and_kills_nothing() -> None:
    core = whole()
    core.preempted(notice(grace=0.2), 0.0)
    assert ending(core).kill_at == 0.0  # never below zero: the grace less 0.5 s
    assert core.exited(3) == [Exit(3)]
    assert core.tick(100.0, None) == []


def test_an_ending_program_paused_between_turns_is_resumed_to_act_and_never_paused_again() -> None:
    core = fraction()
    core.dropped(1.0)  # paused between its turns
    actions = core.preempted(notice(), 2.0)
    assert actions[1:] == [Resume(), Forward(TERM)]
    assert core.granted(2.1) == []  # a grant asked for before: it runs to its end
    assert core.dropped(2.2) == [Release()]  # given back without a pause, and not asked for again
    assert core.tick(2.3, None) == [] and core.run.program == "running"
    assert core.exited(0) == [Exit(0)]


def test_checkpoint_signals_then_yields_waits_for_the_allocation_and_restarts_with_resume() -> None:
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    actions = core.preempted(notice(p.Recovery.CHECKPOINT), 1.0)
    assert actions[1:] == [Forward(USR1)]
    actions = core.exited(0)
    assert actions[1:] == [Yield(), Allocate()] and "waiting for its allocation again" in said(actions)
    assert core.state == Waiting() and not core.run.started
    assert core.revoked(revoked(gone=True), 2.0) == []  # the answer to its YIELD: nothing runs to kill
    assert core.tick(100.0, None) == []  # no kill deadline is left
    again = alloc(resume=True)
    assert core.reallocated(again, 5.0) == [UseAllocation(again, True), Start()]
    assert core.state == Normal("running") and not core.gone
    core.preempted(notice(p.Recovery.CHECKPOINT), 6.0)
    assert said(core.exited(0)) == ""  # the waiting line is said once


def test_a_checkpoint_that_overruns_the_grace_is_killed_and_then_waits_all_the_same() -> None:
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT, grace=5), 0.0)
    assert core.tick(4.5, None)[-1] == Forward(KILL)
    assert kinds(core.exited(128 + KILL)) == [Say, Yield, Allocate]


def test_a_withdrawn_checkpoint_restarts_on_the_allocation_it_keeps_without_yield() -> None:
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT), 0.0)
    assert core.withdrawn(1.0) == []
    assert ending(core).kill_at is None  # the devices stay the run's: no hurry
    assert core.exited(0) == [UseAllocation(alloc(), True), Start()]


def test_a_checkpoint_revoked_before_the_program_ended_is_killed_and_waits_without_yield() -> None:
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT), 0.0)
    assert core.revoked(revoked(gone=True), 1.0) == [Forward(KILL)]
    assert kinds(core.exited(128 + KILL)) == [Say, Allocate]  # gone: nothing to yield


def test_a_fractional_checkpoint_gives_the_lock_back_and_starts_again_at_its_next_grant() -> None:
    core = fraction(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT), 0.0)
    assert kinds(core.exited(0)) == [Release, Say, Yield, Allocate]
    assert core.granted(1.0) == [Release()]  # asked for before: not its turn while it waits
    again = alloc(share=0.5, resume=True)
    assert core.reallocated(again, 2.0) == [UseAllocation(again, True), Request()]
    assert core.granted(3.0) == [Start()]


def test_a_signal_while_waiting_for_the_allocation_ends_the_run_and_a_refusal_fails_it() -> None:
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT), 0.0)
    core.exited(0)
    assert core.signalled(TERM, 1.0) == [Exit(128 + TERM, f"signal {TERM} while the run waited for its allocation")]
    core = whole(recovery="checkpoint", checkpoint_signal=USR1)
    core.preempted(notice(p.Recovery.CHECKPOINT), 0.0)
    core.exited(0)
    assert core.reallocation_failed("no room") == [Say("no room"), Exit(PREEMPTED, "no room")]
    assert core.reallocated(alloc(), 2.0) == []  # too late: the run has ended


def test_suspend_pauses_then_yields_and_resumed_goes_on_where_it_was() -> None:
    core = whole(recovery="suspend")
    actions = core.preempted(notice(p.Recovery.SUSPEND), 1.0)
    assert kinds(actions) == [Say, Pause, Yield]
    assert core.state == Suspended("paused")
    assert core.revoked(revoked(gone=False, state=p.AllocState.SUSPENDED), 2.0) == []  # its YIELD answered
    assert core.withdrawn(2.5) == []  # yielded: too late to undo, it waits for its devices
    assert core.tick(100.0, None) == []  # no deadline while suspended
    actions = core.changed(changed("resumed", alloc()), 200.0)
    assert actions[1:] == [Resume()] and core.state == Normal("running")


def test_suspend_parks_with_a_backend_that_can_and_yields_once_parked() -> None:
    core = whole(recovery="suspend", can_park=True)
    assert kinds(core.preempted(notice(p.Recovery.SUSPEND), 1.0)) == [Say, Pause, Park]
    assert core.park_done(True, "1 bytes") == [Yield()]  # no PARKED: gpud did not ask
    assert core.state == Suspended("parked")
    assert core.signalled(TERM, 2.0) == [Forward(TERM)]  # parked: it acts on it once resumed
    core = whole(recovery="suspend", can_park=True)
    core.preempted(notice(p.Recovery.SUSPEND), 1.0)
    actions = core.park_done(False, "host memory short")
    assert kinds(actions) == [Say, Yield] and "host memory short" in said(actions)


def test_a_suspend_withdrawn_before_it_yielded_resumes_the_program() -> None:
    core = whole(recovery="suspend", can_park=True)
    core.preempted(notice(p.Recovery.SUSPEND), 1.0)  # parking
    assert core.withdrawn(1.5) == []  # the park in flight ends first
    assert core.park_done(True) == [Resume()]
    assert core.state == Normal("running")


def test_a_suspended_fraction_neither_holds_nor_asks_for_the_lock_until_resumed() -> None:
    core = fraction(recovery="suspend")
    assert kinds(core.preempted(notice(p.Recovery.SUSPEND), 1.0)) == [Say, Pause, Release, Yield]
    assert core.granted(2.0) == [Release()]  # granted meanwhile: given back at once
    assert core.dropped(2.1) == [] and core.lost(2.2) == []
    assert core.tick(50.0, 1.0) == []
    assert core.changed(changed("resumed", alloc(share=0.5)), 60.0)[1:] == [Request()]
    assert core.state == Normal("paused")  # it goes on at its grant
    assert core.granted(61.0) == [Resume()]


def test_a_signal_to_a_suspended_run_resumes_the_program_for_the_grace_then_suspends_it_again() -> None:
    core = whole(recovery="suspend", signal_grace=2.0)
    core.preempted(notice(p.Recovery.SUSPEND), 1.0)
    assert core.signalled(TERM, 5.0) == [Resume(), Forward(TERM)]
    assert core.next_tick(5.0, 10.0) == 7.0
    assert kinds(core.tick(7.0, None)) == [Pause]
    assert core.state == Suspended("paused")
    assert core.exited(3) == [Exit(3)]  # it acted on it after all


def test_a_suspended_program_whose_allocation_is_revoked_is_killed_and_the_run_fails() -> None:
    core = whole(recovery="suspend")
    core.preempted(notice(p.Recovery.SUSPEND), 1.0)
    actions = core.revoked(revoked(gone=True), 31.0)
    assert actions[-1] == Forward(KILL) and "gpud revoked the allocation of task job (priority)" in said(actions)
    assert core.exited(128 + KILL) == [Exit(PREEMPTED, said(actions))]


def test_a_revocation_while_the_program_runs_kills_it_at_once() -> None:
    core = whole()
    assert core.revoked(revoked(gone=False), 1.0) == []  # not gone: nothing to do
    actions = core.revoked(revoked(gone=True), 2.0)
    assert kinds(actions) == [Say, Forward] and actions[1] == Forward(KILL)
    assert core.gone
    status = core.exited(128 + KILL)
    assert len(status) == 1 and isinstance(status[0], Exit) and status[0].status == PREEMPTED


def test_fail_ends_the_program_and_the_run_with_a_line_naming_task_reason_and_preemptor() -> None:
    core = whole(recovery="fail")
    assert core.preempted(notice(p.Recovery.FAIL), 0.0)[1:] == [Forward(TERM)]
    actions = core.exited(128 + TERM)
    line = "task job was preempted by urgent (priority); the task fails (--on-preempt fail)"
    assert actions == [Say(line), Exit(PREEMPTED, line)]


def test_a_notice_before_the_program_started_ends_the_run_without_starting_it() -> None:
    core = RunCore()
    core.use_allocation(alloc(share=0.5))
    core.begin(0.0)  # waits for its first grant
    actions = core.preempted(notice(), 1.0)
    assert isinstance(actions[-1], Exit) and actions[-1].status == PREEMPTED
    assert core.granted(2.0) == []  # never started


def test_an_elastic_partial_notice_restarts_the_program_on_the_rest_and_yields() -> None:
    core = whole(alloc([0, 1, 2]), signal_grace=2.0)
    actions = core.preempted(notice(p.Recovery.SHRINK, whole=False, gpus=[2], grace=10), 1.0)
    assert actions[1:] == [Forward(TERM)] and "giving back GPUs [2]" in said(actions)
    assert core.next_tick(1.0, 100.0) == 3.0  # the signal's grace, within the daemon's
    rest = alloc([0, 1])
    assert core.exited(0) == [Yield(), UseAllocation(rest, True), Start()]
    assert core.changed(changed("shrunk", rest), 4.0) == []  # gpud says what it already runs on


def test_an_elastic_resize_with_keep_yields_at_once_and_leaves_the_program_alone() -> None:
    core = whole(alloc([0, 1, 2]), on_resize="keep")
    assert core.preempted(notice(p.Recovery.SHRINK, whole=False, gpus=[2]), 1.0)[1:] == [Yield()]
    assert core.changed(changed("shrunk", alloc([0, 1])), 2.0) == []
    assert core.changed(changed("grown", alloc([0, 1, 3])), 3.0) == []
    assert core.state == Normal("running")


def test_a_grown_allocation_restarts_the_program_on_its_new_gpus_without_yield() -> None:
    core = whole(alloc([0]), signal_grace=2.0)
    bigger = alloc([0, 1])
    actions = core.changed(changed("grown", bigger), 1.0)
    assert actions[1:] == [Forward(TERM)] and "restarting the program" in said(actions)
    assert core.tick(3.0, None)[-1] == Forward(KILL)  # SIGKILL after the signal's grace
    assert core.exited(128 + KILL) == [UseAllocation(bigger, True), Start()]


def test_a_partial_notice_withdrawn_during_the_restart_restarts_on_the_whole_allocation() -> None:
    core = whole(alloc([0, 1]))
    core.preempted(notice(p.Recovery.SHRINK, whole=False, gpus=[1]), 1.0)
    assert core.withdrawn(1.5) == []
    assert core.exited(0) == [UseAllocation(alloc([0, 1]), True), Start()]  # no YIELD: it keeps them


def test_without_drops_the_named_gpus_and_their_uuids() -> None:
    rest = without(alloc([0, 1, 2]), [1])
    assert (rest.gpus, rest.uuids, rest.cuda_visible_devices) == ([0, 2], ["GPU-0", "GPU-2"], "0,2")


def test_a_whole_notice_during_a_restart_keeps_the_earlier_deadline_and_becomes_what_it_asks() -> None:
    core = whole(alloc([0, 1]), signal_grace=2.0)
    core.changed(changed("grown", alloc([0, 1, 2])), 1.0)  # restarting: killed at 3.0
    actions = core.preempted(notice(p.Recovery.TERMINATE, grace=10), 1.5)
    assert "the program is ending already" in said(actions) and Forward(TERM) not in actions
    assert ending(core).kill_at == 3.0
    assert core.exited(3) == [Exit(3)]  # ended as terminate asks, not restarted
    core = whole(alloc([0, 1]), recovery="suspend", signal_grace=2.0)
    core.changed(changed("grown", alloc([0, 1, 2])), 1.0)
    core.preempted(notice(p.Recovery.SUSPEND, grace=10), 1.5)
    assert kinds(core.exited(3)) == [Say, Yield, Allocate]  # told to end already: waits, then resumes


def test_a_second_notice_keeps_the_first_deadline_and_a_notice_while_suspended_changes_nothing() -> None:
    core = whole()
    core.preempted(notice(grace=10), 0.0)
    core.preempted(notice(grace=30), 1.0)
    assert ending(core).kill_at == 9.5
    core = whole(recovery="suspend")
    core.preempted(notice(p.Recovery.SUSPEND), 0.0)
    assert core.preempted(notice(p.Recovery.SUSPEND), 1.0) == []


def test_a_shrink_during_a_restart_changes_the_devices_it_restarts_on() -> None:
    core = whole(alloc([0, 1]), signal_grace=2.0)
    core.changed(changed("grown", alloc([0, 1, 2])), 1.0)
    core.changed(changed("shrunk", alloc([0, 1])), 1.5)  # back to what the program had
    assert core.exited(3) == [UseAllocation(alloc([0, 1]), True), Start()]


# --- the state's rules on seeded random runs ---------------------------------------------------------


def random_call(rng: random.Random, now: float, activity: float) -> Callable[[RunCore], list[RunAction]]:
    """One thing that can happen to a run (or that its driver does), chosen at random."""
    grown = alloc(sorted(rng.sample(range(4), rng.randint(1, 3))), resume=rng.random() < 0.5)
    push = notice(rng.choice(list(p.Recovery)), whole=rng.random() < 0.7, gpus=[1], grace=rng.choice([0, 2, 10]))
    calls: list[Callable[[RunCore], list[RunAction]]] = [
        lambda c: c.granted(now),
        lambda c: c.dropped(now),
        lambda c: c.lost(now),
        lambda c: c.park_asked(),
        lambda c: c.tick(now, activity),
        lambda c: c.tick(now, None),
        lambda c: c.escaped(7, "state R"),
        lambda c: c.preempted(push, now),
        lambda c: c.withdrawn(now),
        lambda c: c.revoked(revoked(gone=rng.random() < 0.5), now),
        lambda c: c.changed(changed(rng.choice(["resumed", "grown", "shrunk"]), grown), now),
        lambda c: c.reallocated(grown, now),
        lambda c: c.exited(0) if isinstance(c.state, Ending) else c.tick(now, None),
        lambda c: c.signalled(TERM, now) if c.run.started else c.tick(now, None),
    ]
    if rng.random() < 0.1:
        calls += [lambda c: c.signalled(TERM, now), lambda c: c.exited(3), lambda c: c.failed("x")]
    return rng.choice(calls)


def test_seeded_random_runs_keep_the_rules_of_the_state_after_every_step() -> None:
    """Whatever gpud, the program and the driver say, in any order: a program runs without the lock only
    for a signal's grace, only Normal and Ending hold it, a park is in flight exactly while the driver has
    one to answer, and the run ends with an Exit, after which nothing happens."""
    ends = 0
    for seed in range(300):
        rng = random.Random(seed)
        arbitrated = rng.random() < 0.6
        core = RunCore(
            arbitrated=arbitrated,
            can_park=rng.random() < 0.5,
            idle_release=rng.choice([None, 0.5]),
            signal_grace=1.0,
            recovery=rng.choice(list(p.Recovery)),
            on_resize=rng.choice(["restart", "keep"]),
        )
        core.use_allocation(alloc([0, 1]))
        actions, now, activity, parking = core.begin(0.0), 0.0, 0.0, False
        for _ in range(80):
            now += rng.choice([0.0, 0.1, 0.5, 3.0])
            activity += rng.choice([0.0, 0.1])
            if parking and rng.random() < 0.5:
                actions, parking = core.park_done(rng.random() < 0.7, "m"), False
            elif Resume() in actions and rng.random() < 0.2:
                actions = core.resume_refused("m")
            else:
                actions = random_call(rng, now, activity)(core)
            parking = parking or Park() in actions
            run = core.run
            assert core.shown() in get_args(RunShown)
            if isinstance(run.state, Ended):
                assert isinstance(actions[-1], Exit)
                break
            assert not (arbitrated and run.state == Normal("running") and not run.holding and run.repause_at is None)
            assert not run.holding or isinstance(run.state, Normal | Ending)
            assert (run.parking is not None) == parking
        else:
            continue
        ends += 1
        for _ in range(10):
            assert random_call(rng, now, activity)(core) == []
        assert core.state == Ended() and core.shown() == "ended"
    assert ends > 100  # not vacuous


def test_each_push_about_the_allocation_is_one_typed_event_with_its_trace_name() -> None:
    pushes = [notice(), p.PreemptWithdrawn(task_id="job"), revoked(), changed("grown", alloc([0, 1]))]
    events = [pushed(push) for push in pushes]
    assert [type(e) for e in events] == [Preempted, Withdrawn, Revoked, Changed]
    assert [e.name for e in events] == ["preempt", "withdrawn", "revoked", "changed"]
    assert events[2].trace() == {"reason": "priority", "state": "running", "gone": True}
