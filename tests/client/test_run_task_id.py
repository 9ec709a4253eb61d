"""A run's default task id: no other uid can take it first, since nobody can guess it."""

from __future__ import annotations

import os
import re
import socket

from gpud_client.run.options import default_task_id


def test_a_runs_default_task_id_has_a_random_part_no_other_uid_can_guess() -> None:
    ids = {default_task_id() for _ in range(100)}
    assert len(ids) == 100  # the same host and pid, every time another id
    prefix = re.escape(f"run-{socket.gethostname()}-{os.getpid()}-")
    assert all(re.fullmatch(prefix + r"[0-9a-f]{12}", i) for i in ids)  # 48 random bits
