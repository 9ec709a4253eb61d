"""Who may do what, through the protocol: in process on a fake clock, credentials faked.

A real ``Daemon`` (``tests/inprocess.py``) answers requests through the listener's own
``handle_payload``. Each client is a connection with the uid, gid and supplementary groups
the test gives it, so a refusal to a non-admin needs neither root nor a forked child; the
daemon's uid is this process's, and uid 0 is an admin, as on a real node. That the kernel's
credentials are the ones the daemon sees, and a reload by SIGHUP, are tested on a real
daemon in ``tests/integration/test_authority.py``.
"""

from __future__ import annotations

import grp
import subprocess
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from inprocess import Node, Peer

from gpud.host.config import PolicyConfig, TenantConfig
from gpud_client import protocol as p

GIB = 2**30
NOBODY = 65534
OTHER_UID = 65533  # no name needed: a uid is a number
Nodes = Callable[..., Node]


def outcome(peer: Peer, msg: msgspec.Struct) -> list[str]:
    """["ok", ""] or [error code, message]: what the daemon answered."""
    answer = peer.call(msg)
    assert answer is not None, f"no answer to {msg!r}"
    if isinstance(answer, p.Error):
        return [str(answer.code), answer.message]
    return ["ok", ""]


def codes(results: dict[str, list[str]]) -> dict[str, str]:
    return {k: v[0] for k, v in results.items()}


def root(node: Node, name: str = "root") -> Peer:
    return node.connect(name, uid=0, gid=0)


def nobody(node: Node, name: str, **who: Any) -> Peer:
    """A client under uid/gid 65534 with no supplementary groups, unless ``who`` says otherwise."""
    return node.connect(name, **({"uid": NOBODY, "gid": NOBODY} | who))


def my_session(peer: Peer, name: str) -> p.SessionInfo:
    session: p.SessionInfo = [c for c in peer.call(p.ListClients(id=0)).clients if c.name == name][0].sessions[0]
    return session


def users_group() -> grp.struct_group:
    """An existing group that is neither root's nor nobody's (gid 100, 'users')."""
    try:
        return grp.getgrgid(100)
    except KeyError:
        pytest.skip("no group with gid 100 on this machine")


def waiting(peer: Peer) -> dict[str, int]:
    return {le.name: le.priority for le in peer.call(p.ListLeases(id=0)).leases if le.state == "waiting"}


# --- 1. an admin's limit is a ceiling -----------------------------------------------


def test_an_admins_limit_is_a_ceiling_the_client_cannot_lift(nodes: Nodes) -> None:
    node = nodes()
    capped = nobody(node, "capped")
    assert isinstance(capped.call(p.Attach(id=0, gpu=0)), p.Attached)
    limited = root(node).call(p.SetLimits(id=0, client="capped", core_limit=30, mem_limit=4 * GIB))  # gpuctl limit
    assert not isinstance(limited, p.Error), limited
    tries = {
        "core 60": outcome(capped, p.SetLimits(id=0, core_limit=60)),
        "core 20": outcome(capped, p.SetLimits(id=0, core_limit=20)),
        "core 30": outcome(capped, p.SetLimits(id=0, core_limit=30)),
        "core 31": outcome(capped, p.SetLimits(id=0, core_limit=31)),
        "mem lifted": outcome(capped, p.SetLimits(id=0, mem_limit=0)),
        "mem 5GiB": outcome(capped, p.SetLimits(id=0, mem_limit=5 * GIB)),
        "mem 1GiB": outcome(capped, p.SetLimits(id=0, mem_limit=GIB)),
    }
    assert codes(tries) == {
        "core 60": "permission_denied",
        "core 20": "ok",
        "core 30": "ok",
        "core 31": "permission_denied",
        "mem lifted": "permission_denied",
        "mem 5GiB": "permission_denied",
        "mem 1GiB": "ok",
    }
    assert "ceiling of 30 %" in tries["core 60"][1]
    s = my_session(capped, "capped")
    assert [s.core_limit, s.core_ceiling, s.mem_limit_bytes, s.mem_ceiling_bytes] == [30, 30, GIB, 4 * GIB]


# --- 2. a fractional allocation's limits, named or not ----------------------------------


def test_a_fractional_allocation_limits_sessions_that_do_not_name_it(nodes: Nodes) -> None:
    node = nodes()
    frac = nobody(node, "frac")
    a = frac.call(p.Allocate(id=0, task_id="frac-task", gpus=0.25, prefer=[1]))
    on_it = frac.call(p.Attach(id=0, gpu=a.gpus[0]))  # no task_id, no labels
    elsewhere = frac.call(p.Attach(id=0, gpu=0))
    assert a.gpus == [1]
    assert [on_it.core_limit, on_it.mem_limit] == [25, 16 * GIB // 4]
    assert [elsewhere.core_limit, elsewhere.mem_limit] == [100, None]
    got = {
        "raise": outcome(frac, p.SetLimits(id=0, session=on_it.session, core_limit=50)),
        "lift": outcome(frac, p.SetLimits(id=0, session=on_it.session, mem_limit=0)),
        "lower": outcome(frac, p.SetLimits(id=0, session=on_it.session, core_limit=10)),
    }
    assert codes(got) == {"raise": "permission_denied", "lift": "permission_denied", "lower": "ok"}
    node.close(frac)

    # An allocation a uid made for one of its processes: that process's sessions belong to it,
    # and that wins over the uid's smaller allocation on the same GPU; another uid's sessions
    # from the very same process are not capped by it. The child is a real process, so that
    # what /proc says of it is true.
    with subprocess.Popen(["sleep", "60"]) as child:
        try:
            owner = node.connect("owner", uid=0, gid=0, pid=child.pid)
            owned = owner.call(p.Allocate(id=0, task_id="by-pid", gpus=0.5, prefer=[0], owner_pid=child.pid))
            assert owned.gpus == [0]
            owner.call(p.Allocate(id=0, task_id="root-small", gpus=0.1, prefer=[0]))
            s = owner.call(p.Attach(id=0, gpu=0))
            assert [s.core_limit, s.mem_limit] == [50, 16 * GIB // 2]
            stranger = nobody(node, "child", pid=child.pid).call(p.Attach(id=0, gpu=0))
            assert [stranger.core_limit, stranger.mem_limit] == [100, None]
        finally:
            child.kill()


# --- 3. priority caps -------------------------------------------------------------------


def test_priorities_above_the_callers_maximum_are_refused(nodes: Nodes) -> None:
    users = users_group()
    node = nodes("2", priority_max=40, priority_max_uids={str(NOBODY): 60}, priority_max_groups={users.gr_name: 70})

    def tries(peer: Peer, over: int, at: int) -> dict[str, list[str]]:
        return {
            "over": outcome(peer, p.Attach(id=0, gpu=0, priority=over)),
            "at": outcome(peer, p.Attach(id=0, gpu=0, priority=at)),
            "production": outcome(
                peer,
                p.Allocate(id=0, task_id=f"{peer.conn.name}-1", gpus=0.1, priority_class=p.PriorityClass.PRODUCTION),
            ),
            "best-effort": outcome(
                peer,
                p.Allocate(id=0, task_id=f"{peer.conn.name}-2", gpus=0.1, priority_class=p.PriorityClass.BEST_EFFORT),
            ),
        }

    expected = {"over": "permission_denied", "at": "ok", "production": "permission_denied", "best-effort": "ok"}
    cases: list[
        tuple[dict[str, Any], int]
    ] = [  # (who, its maximum): the uid's setting wins over its groups, then the highest group, then the default
        (dict(uid=NOBODY, gid=NOBODY, groups=frozenset({users.gr_gid})), 60),
        (dict(uid=OTHER_UID, gid=OTHER_UID, groups=frozenset({users.gr_gid})), 70),
        (dict(uid=OTHER_UID, gid=OTHER_UID, groups=frozenset()), 40),
    ]
    for i, (who, maximum) in enumerate(cases):
        peer = node.connect(f"u{i}", **who)
        got = tries(peer, maximum + 1, maximum)
        node.close(peer)
        assert codes(got) == expected, (who, got)
        assert f"priority {maximum + 1} is above your maximum {maximum}" in got["over"][1]
        assert f"priority 100 is above your maximum {maximum}" in got["production"][1]

    admin = root(node)
    assert admin.call(p.Attach(id=0, gpu=0, priority=100)).session
    assert (
        admin.call(p.Allocate(id=0, task_id="root-prod", gpus=0.1, priority_class=p.PriorityClass.PRODUCTION)).priority
        == 100
    )


def test_a_lease_asking_above_its_policy_gets_the_policys_priority(nodes: Nodes) -> None:
    node = nodes("2", priority_max_uids={str(NOBODY): 60})
    holder, eager = root(node, "holder"), root(node, "eager")
    held = holder.call(p.Acquire(id=0, gpu=1, task_type="OTHER"))
    assert held.acquired
    assert eager.exchange(p.Acquire(id=5, gpu=1, task_type="OTHER", priority=99, max_wait_ms=20_000)) == []
    modest = nobody(node, "modest")
    refused = modest.call(p.Acquire(id=0, gpu=1, task_type="OTHER", priority=61, max_wait_ms=20_000))
    assert isinstance(refused, p.Error)  # its own cap first
    assert refused.code == p.ErrorCode.PERMISSION_DENIED
    assert "lease priority 61 is above your maximum 60" in refused.message
    assert modest.exchange(p.Acquire(id=6, gpu=1, task_type="OTHER", priority=55, max_wait_ms=20_000)) == []
    assert waiting(holder) == {"eager": 50, "modest": 50}  # OTHER's policy: 99 and 55 are cut to 50
    assert isinstance(holder.call(p.Release(id=0, lease_id=held.lease_id)), p.Ok)
    [first] = eager.received()
    assert first.id == 5 and first.acquired  # equal priorities: first come, first served
    assert modest.received() == []
    assert isinstance(eager.call(p.Release(id=0, lease_id=first.lease_id)), p.Ok)
    [second] = modest.received()
    assert second.id == 6 and second.status == p.LeaseStatus.ACQUIRED


def test_naming_a_task_type_gives_no_more_priority_than_the_caller_may_declare(nodes: Nodes) -> None:
    """ASR's default policy has priority 90, above a non-admin's maximum of 50: a stranger's ASR
    lease waits at 50; a uid a reserved policy names gets its 90; anyone else is refused it."""
    users = users_group()
    tts = PolicyConfig(priority=70, busy_policy=p.BusyPolicy.WAIT, max_wait_ms=20_000, gids=[users.gr_gid])
    node = nodes("2", policies={"TTS": tts})
    holder = root(node, "holder")
    held = holder.call(p.Acquire(id=0, gpu=1, task_type="OTHER"))
    assert held.acquired

    def asks(task_type: str, **who: Any) -> Peer:
        peer = node.connect(f"asks-{task_type}", uid=OTHER_UID, gid=OTHER_UID, **who)
        peer.send(p.Acquire(id=7, gpu=1, task_type=task_type, max_wait_ms=20_000))
        return peer

    outsider = asks("TTS")
    [refused] = outsider.received()
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.PERMISSION_DENIED
    assert f"task type TTS is reserved for uids [] and gids [{users.gr_gid}]" in refused.message
    node.close(outsider)
    stranger, member = asks("ASR"), asks("TTS", groups=frozenset({users.gr_gid}))
    assert stranger.received() == [] and member.received() == []
    assert waiting(holder) == {"asks-ASR": 50, "asks-TTS": 70}
    assert isinstance(holder.call(p.Release(id=0, lease_id=held.lease_id)), p.Ok)
    [got] = member.received()
    assert got.status == p.LeaseStatus.ACQUIRED  # 70 before 50, though it came later
    assert stranger.received() == []
    node.close(member)  # it has what it asked for and goes: its lease with it
    [got] = stranger.received()
    assert got.status == p.LeaseStatus.ACQUIRED


# --- 4. another uid's task id -------------------------------------------------------------


def test_another_uids_task_is_neither_shown_nor_freed(nodes: Nodes) -> None:
    tenants = {"open": TenantConfig(gpus=1), "listed": TenantConfig(gpus=1, uids=[NOBODY])}
    node = nodes("2", tenants=tenants)
    admin = root(node)
    for task, tenant in [("t1", None), ("o1", "open"), ("l1", "listed")]:
        assert isinstance(admin.call(p.Allocate(id=0, task_id=task, gpus=0.25, tenant=tenant)), p.Allocated)

    stranger = nobody(node, "stranger")
    stolen = outcome(stranger, p.Allocate(id=0, task_id="t1", gpus=0.25))
    assert stolen[0] == "permission_denied", stolen  # not the devices of t1
    assert "belongs to uid 0" in stolen[1]
    got = {
        "free t1": outcome(stranger, p.Free(id=0, task_id="t1")),
        "free o1": outcome(stranger, p.Free(id=0, task_id="o1")),
        "free l1": outcome(stranger, p.Free(id=0, task_id="l1")),
        "own open": outcome(stranger, p.Allocate(id=0, task_id="n1", gpus=0.25, tenant="open")),
        "free own": outcome(stranger, p.Free(id=0, task_id="n1")),
    }
    assert codes(got) == {
        "free t1": "permission_denied",
        "free o1": "permission_denied",  # a tenant without uids/gids lets anyone allocate, not free others' tasks
        "free l1": "ok",  # a listed member may
        "own open": "ok",
        "free own": "ok",
    }
    listing = admin.call(p.ListAllocations(id=0))
    assert sorted(a.task_id for a in listing.allocations) == ["o1", "t1"]


# --- 6. control characters in names -----------------------------------------------------------


def test_names_with_control_characters_are_refused_at_decode(nodes: Nodes) -> None:
    node = nodes()
    conn = node.connect("raw", hello=False)

    def send(obj: dict[str, Any]) -> Any:
        conn.feed(msgspec.msgpack.encode(obj))
        [answer] = conn.received()
        return answer

    hello: dict[str, Any] = {"type": "HELLO", "id": 1, "version": p.PROTOCOL_VERSION}
    bad_hellos: list[tuple[dict[str, Any], str]] = [
        ({"name": "evil\x1b[2J"}, "$.name"),
        ({"labels": {"team": "a\nb"}}, "$.labels"),
        ({"labels": {"te\x07am": "a"}}, "$.labels"),
    ]
    for bad, where in bad_hellos:
        err = send({**hello, **bad})
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.INVALID, err
        assert where in err.message, err.message
    assert isinstance(send({**hello, "name": "fine"}), p.Welcome)  # the connection goes on
    acquire = {"type": "ACQUIRE", "id": 2, "gpu": 0, "task_type": "OTHER"}
    err = send({**acquire, "trace": {"job_id": "j\r1"}})
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.INVALID and "$.trace" in err.message, err
    clients = conn.call(p.ListClients(id=3)).clients
    assert [c.name for c in clients] == ["fine"]
    assert conn.call(p.ListLeases(id=4)).leases == []
