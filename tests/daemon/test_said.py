"""What the daemon says of allocations is what is so: a best-effort allocation inside its minimum
runtime says so and until when, in ALLOCATE's answer and in ALLOCS alike; a production request that
finds nothing to take back says why in its refusal, in the waiters' listing and in the log; the
restored count at start counts allocations, not the preemption history of tasks that ended.

In-process (``tests/inprocess.py``): a real ``Daemon`` on a fake clock, its store on a real SQLite file.
"""

from __future__ import annotations

from collections.abc import Callable

from inprocess import Node  # tests/ is on the path of its top-level modules
from structlog.testing import capture_logs

from gpud_client import protocol as p

from .test_preemption import alloc, listing, state_of

MIN_RUNTIME_S = 300
BLOCKED = "nothing could be taken back: be: inside its minimum runtime for"


def test_inside_its_minimum_runtime_is_said_with_when(nodes: Callable[..., Node]) -> None:
    node = nodes("1x16GiB", preemption_min_runtime_s=MIN_RUNTIME_S)
    holder = node.connect("holder")
    got = alloc(holder, "be", gpus=1.0, priority_class=p.PriorityClass.BEST_EFFORT)
    assert (got.preemptible, got.why, got.preemptible_in_s) == (
        False,
        "inside its minimum runtime for 300 s more",
        300.0,
    )
    node.advance_s(60)
    a = state_of(holder, "be")
    assert (a.preemptible, a.why, a.preemptible_in_s) == (False, "inside its minimum runtime for 240 s more", 240.0)
    node.advance_s(240)
    a = state_of(holder, "be")
    assert (a.preemptible, a.why, a.preemptible_in_s) == (True, "", None)


def test_a_production_request_says_why_nothing_could_be_taken(nodes: Callable[..., Node]) -> None:
    node = nodes("1x16GiB", preemption_min_runtime_s=MIN_RUNTIME_S)
    holder = node.connect("holder")
    alloc(holder, "be", gpus=1.0, priority_class=p.PriorityClass.BEST_EFFORT)
    admin = node.connect("admin", uid=0, gid=0)
    with capture_logs() as logs:
        refused = admin.call(p.Allocate(id=0, task_id="now", gpus=1.0, priority=100))
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.INSUFFICIENT
    assert BLOCKED in refused.message and "for 300 s more" in refused.message
    [line] = [e for e in logs if e["event"] == "allocation_refused"]
    assert line["task_id"] == "now" and BLOCKED in line["why"]
    admin.send(p.Allocate(id=9, task_id="prod", gpus=1.0, priority=100, wait_ms=60_000))
    node.advance_s(10)
    [w] = listing(holder).waiters
    assert w.task_id == "prod" and BLOCKED in w.why and "for 290 s more" in w.why
    with capture_logs() as logs:
        node.advance_s(50)
    [expired] = admin.received()
    assert isinstance(expired, p.Error) and expired.code == p.ErrorCode.INSUFFICIENT
    assert BLOCKED in expired.message and "for 240 s more" in expired.message
    [line] = [e for e in logs if e["event"] == "allocation_expired"]
    assert line["task_id"] == "prod" and "for 240 s more" in line["why"]


def test_the_restored_count_is_of_allocations_with_history_apart(nodes: Callable[..., Node]) -> None:
    first = nodes("1x16GiB", preemption_min_runtime_s=0, preemption_grace_s=10)
    holder = first.connect("holder")
    alloc(holder, "ck", gpus=1.0, priority=10, on_preempt=p.Recovery.CHECKPOINT)
    admin = first.connect("admin", uid=0, gid=0)
    admin.send(p.Allocate(id=3, task_id="prod", gpus=1.0, priority=100, wait_ms=60_000))
    assert isinstance(holder.call(p.Yield(id=0, task_id="ck")), p.Ok)  # ck's history is kept: it resumes
    [granted] = admin.received()
    assert isinstance(granted, p.Allocated)
    assert isinstance(admin.call(p.Free(id=0, task_id="prod")), p.Ok)  # no allocation is left, only history
    first.close_store()
    with capture_logs() as logs:
        again = Node("1x16GiB", state_dir=first.config.state_dir)
    try:
        [line] = [e for e in logs if e["event"] == "allocations_restored"]
        assert (line["count"], line["suspended"], line["waits"], line["history"]) == (0, 0, 0, 1)
        assert again.daemon.allocations.ledger.history_of("ck") == (1, True)
    finally:
        again.close_store()
