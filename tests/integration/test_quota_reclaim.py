"""Quota reclaim on a real daemon: a tenant that lent its idle quota asks for it, and the borrower's
newest allocation is taken back with its notice and grace. Real daemon on a real socket, the
borrower a real client process's connection (this test's ``Client``, listening for PREEMPT)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p

TENANTS = """
preemption_grace_s = 30
preemption_min_runtime_s = 600
[tenants.research]
gpus = 1
[tenants.batch]
gpus = 1
borrow = 1
"""


def test_the_lender_asking_for_its_quota_takes_back_the_borrowers_newest(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    config = tmp_path / "gpud.toml"
    config.write_text(TENANTS)
    d = daemon_factory("--simulate", "2", "--config", str(config))
    pushes: queue.Queue[object] = queue.Queue()
    with Client(d.socket, name="batch") as borrower, Client(d.socket, name="research") as lender:
        borrower.add_allocation_listener(pushes.put)
        own = borrower.allocate("batch-1", 1, tenant="batch", priority="normal", owner_pid=os.getpid())
        lent = borrower.allocate("batch-2", 1, tenant="batch", priority="normal", owner_pid=os.getpid())
        assert sorted(own.gpus + lent.gpus) == [0, 1]  # the second GPU is research's, lent
        answer: queue.Queue[object] = queue.Queue()

        def ask() -> None:
            answer.put(lender.allocate("research-1", 1, tenant="research", priority="best-effort", wait_ms=60_000))

        t = threading.Thread(target=ask)
        t.start()
        notice = pushes.get(timeout=30)
        # Its own quota's allocation stays; the borrowed one (the newest) goes, whatever its priority
        # (normal, above the lender's best-effort) and however young (the minimum runtime is 10 min).
        assert isinstance(notice, p.Preempt)
        assert (notice.task_id, notice.reason, notice.by) == ("batch-2", p.PreemptReason.QUOTA_RECLAIM, "research-1")
        borrower.yield_allocation("batch-2")
        granted = answer.get(timeout=30)
        t.join()
        assert isinstance(granted, p.Allocated) and granted.gpus == lent.gpus
        held = {a.task_id for a in lender.allocations().allocations}
        assert held == {"batch-1", "research-1"}
