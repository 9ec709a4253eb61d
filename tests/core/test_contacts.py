"""Whom gpud tells about a task, and whom it signals (``gpud.core.contacts``): one record per task,
connections as plain tokens, fake time."""

from __future__ import annotations

import random

from gpud.core.contacts import Contacts, Tell, Waiter, tell_of_notice

GRACE = 30_000_000


def everyone_alive(task_id: str) -> bool:
    return True


def nobody_alive(task_id: str) -> bool:
    return False


def test_a_notice_goes_to_the_holder_else_to_the_owner_only_when_it_must_leave() -> None:
    assert tell_of_notice("conn", whole=True) is Tell.HOLDER
    assert tell_of_notice("conn", whole=False) is Tell.HOLDER
    assert tell_of_notice(None, whole=True) is Tell.OWNER
    assert tell_of_notice(None, whole=False) is Tell.NOBODY
    c: Contacts[str] = Contacts()
    c.hold("t", "a")
    assert c.notice("t", whole=True) == (Tell.HOLDER, "a")
    assert c.notice("u", whole=True) == (Tell.OWNER, None)


def test_a_signalled_owner_is_killed_at_the_take_back_unless_the_notice_was_withdrawn() -> None:
    c: Contacts[str] = Contacts()
    c.owner_signalled("t")
    said = c.taken_back("t", gone=True)
    assert said.kill and said.holder is None
    assert c.get("t") is None, "an ended task is forgotten"
    c.owner_signalled("u")
    assert c.withdrawn("u") is None
    assert not c.taken_back("u", gone=True).kill, "withdrawn: its owner may stay"
    c.owner_signalled("s")
    assert not c.taken_back("s", gone=False).kill, "suspended: it comes back, nobody is killed"
    assert c.signalled("s"), "(still told to leave until its notice ends one way or the other)"


def test_a_holder_that_does_not_listen_is_no_holder_and_a_new_one_replaces_the_old() -> None:
    c: Contacts[str] = Contacts()
    c.hold("t", "a")
    c.hold("t", "b")
    assert c.holder("t") == "b" and c.holds("a") == set() and c.holds("b") == {"t"}
    c.hold("t", "b", listens=False)
    assert c.holder("t") is None and c.holds("b") == set()
    assert c.get("t") is None, "nothing left to say of it: no record kept"


def test_a_closed_connection_ends_its_waits_and_lets_go_of_what_it_held() -> None:
    c: Contacts[str] = Contacts()
    c.wait("w1", "a", 7, 100, listens=True)
    c.wait("w2", "b", 8, 100, listens=True)
    c.hold("h", "a")
    assert c.closed("a") == (["w1"], {"h"})
    assert c.waiter("w1") is None and c.holder("h") is None
    assert dict(c.waiters()) == {"w2": Waiter("b", 8, 100, True)}
    assert c.closed("a") == ([], set()), "closing twice changes nothing"


def test_a_served_wait_makes_its_waiter_the_holder_if_it_listens() -> None:
    c: Contacts[str] = Contacts()
    c.wait("t", "a", 7, 100, listens=True)
    c.wait("d", "a", 8, 100, listens=False)
    assert c.served("t", 200) == Waiter("a", 7, 100, True) and c.holder("t") == "a"
    assert c.served("d", 200) == Waiter("a", 8, 100, False) and c.holder("d") is None


def test_a_restored_wait_served_with_nobody_waiting_is_released_after_the_grace_unless_claimed() -> None:
    c: Contacts[str] = Contacts()
    assert c.served("t", 1_000) is None
    assert c.unclaimed(1_000 + GRACE - 1, GRACE, nobody_alive) == []
    assert c.unclaimed(1_000 + GRACE, GRACE, nobody_alive) == ["t"]
    assert c.unclaimed(1_000 + GRACE, GRACE, everyone_alive) == [], "its owner lives: it may come back"
    c.hold("t", "a", listens=False)  # its client asked again (not listening): claimed all the same
    assert c.unclaimed(10 * GRACE, GRACE, nobody_alive) == []


def test_forgetting_a_task_keeps_the_wait_of_a_new_request_for_it() -> None:
    c: Contacts[str] = Contacts()
    c.hold("t", "a")
    c.owner_signalled("t")
    c.wait("t", "b", 9, 500, listens=True)
    c.forget("t")
    assert c.holder("t") is None and not c.signalled("t") and c.waiter("t") == Waiter("b", 9, 500, True)


def test_reachable_through_a_holder_or_a_live_owner_of_what_it_holds() -> None:
    c: Contacts[str] = Contacts()
    assert not c.reachable("t", everyone_alive, holds=False), "a wait's owner is not signalled"
    assert c.reachable("t", everyone_alive, holds=True)
    assert not c.reachable("t", nobody_alive, holds=True)
    c.hold("t", "a")
    assert c.reachable("t", nobody_alive, holds=False)


def test_the_indexes_follow_the_records_through_any_sequence() -> None:
    """Every connection's tasks are exactly the records that name it, whatever happened before."""
    rng = random.Random(3)
    c: Contacts[str] = Contacts()
    tasks, conns = [f"t{i}" for i in range(6)], ["a", "b", "c"]
    for step in range(3000):
        t, conn = rng.choice(tasks), rng.choice(conns)
        match rng.randrange(9):
            case 0:
                c.wait(t, conn, step, step, rng.random() < 0.7)
            case 1:
                c.take_waiter(t)
            case 2:
                c.served(t, step)
            case 3:
                c.hold(t, conn, rng.random() < 0.8)
            case 4:
                c.closed(conn)
            case 5:
                c.forget(t)
            case 6:
                c.owner_signalled(t)
            case 7:
                c.withdrawn(t)
            case _:
                c.taken_back(t, gone=rng.random() < 0.5)
        held = {(t, h) for t in tasks if (h := c.holder(t)) is not None}
        assert set(c.holders()) == held
        assert {(t, w.conn) for t, w in c.waiters()} == {(t, w.conn) for t in tasks if (w := c.waiter(t))}
        assert all(c.get(t) is None or not c.get(t).empty() for t in tasks)  # type: ignore[union-attr]
