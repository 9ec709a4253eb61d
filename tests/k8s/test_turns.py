"""The rules of one claim's containers (``gpud_k8s.turns``): turns, suspension, eviction, on fake time."""

from __future__ import annotations

import random

from gpud_client.protocol import Recovery
from gpud_k8s.turns import (
    Adopt,
    AnswerPark,
    ClaimTurns,
    Evict,
    Park,
    Pause,
    Release,
    Request,
    Resume,
    TurnConfig,
    Yield,
)

A, B = "/kubepods/pod1/ctr-a", "/kubepods/pod1/ctr-b"


def sliced(recovery: Recovery = Recovery.TERMINATE, can_park: bool = False) -> ClaimTurns:
    return ClaimTurns(TurnConfig(time_slice=True, recovery=recovery, can_park=can_park))


def test_found_containers_are_frozen_at_once_and_run_only_in_their_turn() -> None:
    t = sliced()
    assert t.found((A,), 0) == [Adopt((A,)), Pause(), Request()]
    assert t.granted(1) == [Resume()]
    assert t.found((A, B), 2) == [Adopt((A, B))]  # found in its turn: runs with the other
    assert t.dropped(3) == [Pause(), Release(), Request()]
    assert t.found((A, B), 4) == []  # nothing new
    assert t.found((B,), 5) == [Adopt((B,)), Pause()]  # while waiting: frozen (again, harmlessly)
    assert t.granted(6) == [Resume()]


def test_a_claim_without_containers_asks_for_nothing_and_gives_a_grant_straight_back() -> None:
    t = sliced()
    assert t.granted(0) == [Release()]
    t.found((A,), 1)
    t.granted(2)
    assert t.found((), 3) == [Adopt(()), Release()]  # its containers ended: nothing to run in its turn
    assert t.dropped(4) == []
    assert t.found((A,), 5) == [Adopt((A,)), Pause(), Request()]


def test_a_claim_that_does_not_take_turns_only_adopts_its_containers() -> None:
    t = ClaimTurns(TurnConfig(time_slice=False, recovery=Recovery.SUSPEND))
    assert t.found((A,), 0) == [Adopt((A,))]
    assert t.program == "running"
    assert t.preempted(Recovery.SUSPEND, 30, 1) == [Pause(), Yield()]
    assert t.found((A, B), 2) == [Adopt((A, B)), Pause()]  # suspended: a new container is frozen too
    assert t.resumed(3) == [Resume()]


def test_suspend_pauses_parks_gives_back_and_waits_for_resumed() -> None:
    t = sliced(Recovery.SUSPEND, can_park=True)
    t.found((A,), 0)
    t.granted(1)
    assert t.preempted(Recovery.SUSPEND, 30, 2) == [Pause(), Release(), Park()]
    assert t.granted(3) == [Release()]  # a grant asked for before is not the claim's now
    assert t.park_done(True, "") == [Yield()]
    assert (t.mode, t.program) == ("suspended", "parked")
    assert t.resumed(4) == [Request()]
    assert t.granted(5) == [Resume()]


def test_another_recovery_evicts_at_the_graces_end_unless_withdrawn() -> None:
    t = sliced(Recovery.CHECKPOINT)
    t.found((A,), 0)
    assert t.preempted(Recovery.CHECKPOINT, 30, 10) == []
    assert t.next_tick(10, 5) == 15 and t.next_tick(38, 5) == 40
    assert t.tick(39.9) == []
    t.granted(20)  # turns go on meanwhile
    assert t.tick(40) == [Evict("the claim's preemption grace is over")]
    assert t.tick(41) == []
    assert t.revoked(True, 42) == [Pause(), Release()]  # gone: paused for good, evicted once
    assert t.found((A, B), 43) == [Adopt((A, B)), Pause()]
    assert t.granted(44) == [Release()]

    w = sliced()
    w.found((A,), 0)
    w.preempted(Recovery.TERMINATE, 30, 0)
    assert w.withdrawn(5) == []
    assert w.tick(31) == [] and w.mode == "turns"


def test_an_allocation_taken_with_no_notice_pauses_and_evicts() -> None:
    t = sliced()
    t.found((A,), 0)
    t.granted(1)
    assert t.revoked(True, 2) == [Pause(), Release(), Evict("gpud took the claim's allocation back")]
    assert t.terminating(3) == []  # no GPU to end on: stays paused


def test_a_pod_being_deleted_runs_to_act_on_its_sigterm_and_takes_no_more_turns() -> None:
    t = sliced(Recovery.SUSPEND)
    t.found((A,), 0)
    assert t.terminating(1) == [Resume()]
    assert t.granted(2) == [Release()]
    assert t.preempted(Recovery.SUSPEND, 30, 3) == []
    assert t.found((A, B), 4) == [Adopt((A, B))]


def test_park_is_answered_by_what_the_pause_can_do() -> None:
    t = sliced()
    assert t.park_asked() == [AnswerPark(True)]  # nothing on the GPU
    t.found((A,), 0)
    t.granted(1)
    assert t.park_asked() == [AnswerPark(False, "the claim's containers hold the GPU again")]
    t.dropped(2)
    (answer,) = t.park_asked()
    assert isinstance(answer, AnswerPark) and not answer.ok and "pause: cuda" in answer.message
    c = sliced(can_park=True)
    c.found((A,), 0)
    assert c.park_asked() == [Park()]
    assert c.park_asked() == []  # one in flight answers both
    assert c.park_done(True, "1 bytes") == [AnswerPark(True, "1 bytes")]
    assert c.granted(1) == [Resume()]


def test_a_random_walk_never_lets_containers_run_without_a_turn_or_an_allocation() -> None:
    """Whatever happens, in any order: containers run only while the claim holds the lock (time-sliced,
    its pods not being deleted), and never once its allocation is gone; one request at most is out."""
    rng = random.Random(34)
    for _ in range(300):
        t = sliced(rng.choice(list(Recovery)), can_park=rng.random() < 0.5)
        runs: set[str] = set()  # the adopted cgroups that are not frozen, as the actions left them
        adopted: tuple[str, ...] = ()
        now = 0.0
        for _ in range(60):
            now += rng.random() * 10
            step = rng.randrange(11)
            acts = (
                t.found(tuple(sorted(rng.sample([A, B], rng.randrange(3)))), now) if step == 0
                else t.granted(now) if step == 1 and t.asked
                else t.dropped(now) if step == 2
                else t.park_asked() if step == 3
                else t.park_done(rng.random() < 0.5) if step == 4 and t.parking
                else t.preempted(rng.choice(list(Recovery)), 30, now) if step == 5
                else t.withdrawn(now) if step == 6
                else t.resumed(now) if step == 7
                else t.revoked(rng.random() < 0.5, now) if step == 8
                else t.tick(now) if step == 9
                else t.terminating(now) if rng.random() < 0.1
                else []
            )  # fmt: skip
            for a in acts:
                if isinstance(a, Adopt):  # a container found is running until frozen
                    runs = (runs & set(a.cgroups)) | (set(a.cgroups) - set(adopted))
                    adopted = a.cgroups
                elif isinstance(a, Resume):
                    runs = set(adopted)
                elif isinstance(a, Pause):
                    runs = set()
            assert adopted == t.cgroups
            if t.mode != "ending":
                assert not runs or t.holding, (t, acts)
            if t.mode == "gone":
                assert not runs and not t.holding
            assert bool(runs) == (t.program == "running") or not t.cgroups, (t, acts, runs)
            assert acts.count(Request()) <= 1
