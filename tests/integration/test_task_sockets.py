"""A task's own socket (OPEN_TASK_SOCKET), on a real daemon: every connection on it is the task's,
whatever its uid, and asks only what gpud.core.scopes serves; the socket goes with CLOSE_TASK_SOCKET
and with the daemon, and comes back when opened again after a restart."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, ProtocolError
from gpud_client import protocol as p

TASK = "k8s-claim-1"


def claim_dir(d: DaemonProcess, name: str = "claim-1") -> Path:
    path = Path(d.workdir, "claims", name)
    path.mkdir(parents=True, mode=0o755)
    os.chmod(path, 0o755)
    return path


def opened(d: DaemonProcess) -> tuple[Client, Path]:
    """An admin's client (the tests' uid is the daemon's) with a quarter of GPU 1 for TASK, and its socket."""
    admin = Client(d.socket)
    admin.allocate(TASK, gpus=0.25, prefer=[1])
    sock = claim_dir(d) / "gpud.sock"
    admin.call(p.OpenTaskSocket(id=0, task_id=TASK, path=str(sock)))
    return admin, sock


def refused(c: Client, msg: object, code: p.ErrorCode = p.ErrorCode.PERMISSION_DENIED) -> str:
    with pytest.raises(ProtocolError) as info:
        c.call(msg)  # type: ignore[arg-type]
    assert info.value.code == code, info.value
    return str(info.value)


def test_a_connection_on_a_tasks_socket_is_that_tasks_and_no_admin(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    admin, sock = opened(d)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o666
    with admin, Client(str(sock)) as c:
        assert len(c.status().gpus) == 2  # reading the node: served
        assert "is not served on the socket of task 'k8s-claim-1'" in refused(c, p.SetTq(id=0, seconds=1.0))
        refused(c, p.ListClients(id=0))
        refused(c, p.Free(id=0, task_id=TASK))
        refused(c, p.OpenTaskSocket(id=0, task_id="other", path=str(sock)))
        # its sessions are its allocation's: the share is their ceiling, on its GPU alone
        attached = c.call(p.Attach(id=0, gpu=1, core_limit=100))
        assert attached.core_limit == 25
        assert "runs on its allocation's GPUs" in refused(c, p.Attach(id=0, gpu=0))
        assert "belongs to it, not to 'other'" in refused(c, p.Attach(id=0, gpu=1, task_id="other"))
        # its allocation: held as it is (whatever terms are sent), never another's, never a new one
        held = c.call(p.Allocate(id=0, task_id=TASK, existing=True))
        assert (held.task_id, held.gpus, held.share) == (TASK, [1], 0.25)
        assert "alone, not 'other'" in refused(c, p.Allocate(id=0, task_id="other", existing=True))
        assert "it makes none" in refused(c, p.Allocate(id=0, task_id=TASK))
        listing = c.call(p.ListAllocations(id=0))
        assert [a.task_id for a in listing.allocations] == [TASK]
        admin.allocate("someone-else", gpus=0.5, prefer=[0])
        assert [a.task_id for a in c.call(p.ListAllocations(id=0)).allocations] == [TASK], "another task is not shown"


def test_opening_is_idempotent_and_checks_the_directory(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    admin, sock = opened(d)
    with admin:
        admin.call(p.OpenTaskSocket(id=0, task_id=TASK, path=str(sock)))  # the same again: nothing changes
        other = claim_dir(d, "claim-2") / "gpud.sock"
        assert "has its socket at" in refused(
            admin, p.OpenTaskSocket(id=0, task_id=TASK, path=str(other)), p.ErrorCode.INVALID
        )
        assert "another task's socket" in refused(
            admin, p.OpenTaskSocket(id=0, task_id="t2", path=str(sock)), p.ErrorCode.INVALID
        )
        open_dir = claim_dir(d, "claim-3")
        os.chmod(open_dir, 0o777)
        message = refused(admin, p.OpenTaskSocket(id=0, task_id="t3", path=str(open_dir / "gpud.sock")))
        assert "writable by no one else" in message and "mode 777" in message
        link = Path(d.workdir, "claims", "link")
        link.symlink_to(claim_dir(d, "claim-4"))
        assert "not a directory" in refused(
            admin, p.OpenTaskSocket(id=0, task_id="t4", path=str(link / "gpud.sock")), p.ErrorCode.INVALID
        )
        missing = Path(d.workdir, "claims", "missing", "gpud.sock")
        assert "cannot be used" in refused(
            admin, p.OpenTaskSocket(id=0, task_id="t5", path=str(missing)), p.ErrorCode.INVALID
        )
        assert not missing.parent.exists(), "gpud makes no directory of its own"


def test_closing_drops_its_connections_and_removes_the_socket(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    admin, sock = opened(d)
    with admin:
        c = Client(str(sock), reconnect=False)
        c.status()
        admin.call(p.CloseTaskSocket(id=0, task_id=TASK))
        assert not sock.exists()
        with pytest.raises(Exception):  # noqa: B017  (dropped: the next call finds the connection gone)
            c.status()
        c.close()
        admin.call(p.CloseTaskSocket(id=0, task_id=TASK))  # none: nothing to do
        assert admin.allocations().allocations[0].task_id == TASK, "the allocation is the admin's to free"


def test_after_a_restart_the_socket_is_opened_again(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--simulate", "2x16GiB")
    admin, sock = opened(d)
    admin.close()
    d.stop()
    assert not sock.exists(), "a daemon that stops removes its task sockets"
    d.start()
    with Client(d.socket) as admin:
        admin.call(p.OpenTaskSocket(id=0, task_id=TASK, path=str(sock)))
        with Client(str(sock)) as c:
            assert c.call(p.Allocate(id=0, task_id=TASK, existing=True)).share == 0.25
