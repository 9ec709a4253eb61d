"""A client with no daemon to talk to gets a clear error. What bad input does to the daemon is
tested in process (``tests/daemon/test_bad_input.py``)."""

from __future__ import annotations

import pytest

from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable


def test_no_daemon_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(DaemonUnavailable, match="is gpud running"):
        Connection("/tmp/gpud-no-such-dir/gpud.sock")
