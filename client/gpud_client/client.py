"""The synchronous client: one connection, one reader thread, sessions.

``with session.slice():`` wraps one unit of GPU work. It takes the GPU lock if
the session does not hold it, and at exit gives it back only if a DROP_LOCK is
pending; between slices the lock is kept, so a training loop pays no round trip
per step. A DROP_LOCK that arrives between slices is answered at once, and a
lock unused for ``idle_release`` seconds is given back early (nvshare's early
release).

When the daemon goes away the reader thread reconnects with backoff and
re-attaches every session (the locks themselves are gone with the daemon). A
slice started meanwhile waits up to ``unavailable_timeout`` seconds for the
daemon and then raises ``DaemonUnavailable`` or, with
``proceed_unarbitrated=True``, runs without the lock. That is the documented
choice; nothing else is silent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import DaemonUnavailable, GpudError, MemoryLimitExceeded, ProtocolError, error_from
from gpud_client._requests import (
    SessionFields,
    acquire_msg,
    acquire_timeout,
    allocate_msg,
    apply_limits,
    attach_msg,
    bind,
    granted,
    memory_to_report,
    policy_msg,
    revoked,
    size,
)

log = logging.getLogger("gpud_client")
_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 2.0


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: Any = None


class _Slice:
    """The context of ``Session.slice``: a class, not a generator, because a slice's entry and exit run
    between every two kernels while the lock is held, and every microsecond there is billed GPU time."""

    __slots__ = ("session", "arbitrated")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.arbitrated = False

    def __enter__(self) -> Session:
        s = self.session
        self.arbitrated = s.client._enter_slice(s)
        return s

    def __exit__(self, *exc: object) -> None:
        if self.arbitrated:
            s = self.session
            s.client._exit_slice(s)


class Session(SessionFields):
    """A process's place on one GPU. Create with ``Client.session``."""

    def __init__(
        self,
        client: Client,
        gpu: int | str,
        *,
        priority: int,
        idle_release: float | None,
        on_drop: Callable[[p.DropReason], None] | None,
        synchronize: Callable[[], None] | None,
        core_limit: int = 100,
        mem_limit: int | None = None,
        mem_estimate: int | None = None,
        memory_probe: Callable[[], int] | None = None,
        framework_hooks: bool = True,
    ) -> None:
        super().__init__(
            gpu, priority=priority, idle_release=idle_release, core_limit=core_limit, mem_limit=mem_limit,
            mem_estimate=mem_estimate, memory_probe=memory_probe, framework_hooks=framework_hooks,
        )
        self.client = client
        self.on_drop = on_drop
        self.synchronize = synchronize
        self.reattach_error: GpudError | None = None  # the daemon refused it after a reconnect

    def slice(self) -> _Slice:
        """One unit of GPU work under the lock: ``with session.slice(): ...``."""
        return _Slice(self)

    def acquire(self) -> None:
        """Take the lock and keep it until ``release``: an open-ended slice.

        Neither idle release nor a DROP_LOCK takes it away meanwhile (a drop is
        reported to ``on_drop``); ignoring drops past the daemon's drop timeout
        gets the lock revoked."""
        self.client._enter_slice(self)

    def release(self) -> None:
        """End an ``acquire`` (or give back a lock kept between slices) now."""
        self.client._release(self)

    def report_memory(self, used_bytes: int) -> None:
        """Tell the daemon how much GPU memory this session uses (MEM_UPDATE)."""
        self.client._report_memory(self, used_bytes)

    def set_limits(self, *, core_limit: int | None = None, mem_limit: int | str | None = None) -> None:
        """Change this session's own limits; the window's use is kept."""
        self.client.call(p.SetLimits(id=0, session=self.id, core_limit=core_limit, mem_limit=size(mem_limit)))

    def close(self) -> None:
        self.client._detach(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A connection to gpud shared by the sessions of one process."""

    def __init__(
        self,
        socket: str | None = None,
        *,
        name: str = "",
        labels: dict[str, str] | None = None,
        reconnect: bool = True,
        unavailable_timeout: float = 10.0,
        proceed_unarbitrated: bool = False,
        request_timeout: float = 10.0,
    ) -> None:
        self.path = p.resolve_socket_path(socket)
        self.name = name
        self.labels = dict(labels or {})
        self.reconnect = reconnect
        self.unavailable_timeout = unavailable_timeout
        self.proceed_unarbitrated = proceed_unarbitrated
        self.request_timeout = request_timeout
        # One lock for all client state. The slice paths take it bare (a C-level context manager,
        # no Python frames: that time is billed while the lock is kept between slices).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # The idle thread waits on its own condition (same lock), so the reader's
        # and every slice's notifications do not wake it for nothing.
        self._idle_cond = threading.Condition(self._lock)
        self._idle_wake_at = math.inf  # when the idle thread looks next
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._lock_requests: dict[int, Session] = {}  # LOCK_REQUEST id -> session
        self._sessions: dict[int, Session] = {}  # daemon session id -> session
        self._all: list[Session] = []
        self._closed = False
        self.scheduler_on: dict[int, bool] = {}
        self.reconnects = 0
        self.revoked_leases: set[str] = set()
        self._abandoned: set[int] = set()  # ACQUIREs nobody waits for any more
        self._conn: Connection | None = None
        self._open()  # the first connect fails loudly: DaemonUnavailable
        self._reader = threading.Thread(target=self._read_loop, name="gpud-client-reader", daemon=True)
        self._reader.start()
        self._idle = threading.Thread(target=self._idle_loop, name="gpud-client-idle", daemon=True)
        self._idle.start()

    # --- public API -----------------------------------------------------------

    @property
    def client_id(self) -> int:
        return self.welcome.client_id

    def session(
        self,
        gpu: int | str = 0,
        *,
        priority: int = 0,
        idle_release: float | None = 1.0,
        on_drop: Callable[[p.DropReason], None] | None = None,
        synchronize: Callable[[], None] | None = None,
        core_limit: int = 100,
        mem_limit: int | str | None = None,
        mem_estimate: int | str | None = None,
        memory_probe: Callable[[], int] | None = None,
        framework_hooks: bool = True,
    ) -> Session:
        """Attach to a GPU. ``core_limit``: percent of GPU time per window;
        ``mem_limit``/``mem_estimate``: bytes or sizes such as "8GiB".
        ``memory_probe`` is read at each slice's end and reported when it
        moved; with torch already imported, PyTorch's reserved memory is the
        default probe and ``mem_limit`` also caps PyTorch's allocator."""
        s = Session(
            self, gpu, priority=priority, idle_release=idle_release, on_drop=on_drop, synchronize=synchronize,
            core_limit=core_limit, mem_limit=size(mem_limit), mem_estimate=size(mem_estimate),
            memory_probe=memory_probe, framework_hooks=framework_hooks,
        )
        reply = self.call(attach_msg(s))
        with self._cond:
            self._bind(s, reply)
            self._all.append(s)
        return s

    def call(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        """Send a request and wait for its answer; an Error becomes an exception."""
        conn = self._require_conn()
        pend = _Pending()
        with self._cond:
            rid = conn.next_id()
            msg = msgspec.structs.replace(msg, id=rid)
            self._pending[rid] = pend
        try:
            self._send(conn, msg)
            wait = self.request_timeout if timeout is None else timeout
            if not pend.event.wait(wait):
                if isinstance(msg, p.Acquire):
                    with self._cond:
                        self._abandoned.add(rid)  # a grant that comes later is given straight back
                raise DaemonUnavailable(f"gpud did not answer {type(msg).__name__} within {wait} s")
        finally:
            with self._cond:
                self._pending.pop(rid, None)
        reply = pend.reply
        if isinstance(reply, GpudError):
            raise reply
        if isinstance(reply, p.Error):
            raise error_from(reply.code, reply.message)
        return reply

    def status(self) -> p.StatusReply:
        reply: p.StatusReply = self.call(p.Status(id=0))
        return reply

    def clients(self) -> p.ClientsReply:
        reply: p.ClientsReply = self.call(p.ListClients(id=0))
        return reply

    def set_tq(self, seconds: float, gpu: int | str | None = None) -> None:
        self.call(p.SetTq(id=0, seconds=seconds, gpu=gpu))

    def set_scheduler(self, on: bool, gpu: int | str | None = None) -> None:
        self.call(p.SchedOn(id=0, gpu=gpu) if on else p.SchedOff(id=0, gpu=gpu))

    # --- leases (GpuArbiter) ---------------------------------------------------

    @contextmanager
    def lease(self, gpu: int | str = "gpu:0", task_type: str = "OTHER", **fields: Any) -> Iterator[p.LeaseResult]:
        """``with client.lease("gpu:0", task_type="ASR") as r:`` -- r.status is
        ACQUIRED, SKIPPED or FALLBACK_CPU; an acquired lease is released on
        exit, exceptions included. ``fields``: those of ``acquire``."""
        result = self.acquire(gpu, task_type, **fields)
        try:
            yield result
        finally:
            if result.acquired and result.lease_id is not None:
                self.release_lease(result.lease_id, wait=False)

    def acquire(
        self,
        gpu: int | str = "gpu:0",
        task_type: str = "OTHER",
        *,
        priority: int | None = None,
        max_wait_ms: int | None = None,
        hold_max_ms: int | None = None,
        queue_limit: int | None = None,
        busy_policy: p.BusyPolicy | str | None = None,
        mem_estimate: int | str | None = None,
        trace: p.Trace | dict[str, Any] | None = None,
    ) -> p.LeaseResult:
        """Ask for a lease; fields left out come from the task type's policy.
        Waits for the answer (at most max_wait, plus the request timeout)."""
        msg = acquire_msg(
            gpu, task_type, priority=priority, max_wait_ms=max_wait_ms, hold_max_ms=hold_max_ms,
            queue_limit=queue_limit, busy_policy=busy_policy, mem_estimate=mem_estimate, trace=trace,
        )
        wait = acquire_timeout(msg, self.request_timeout)
        result: p.LeaseResult = self.call(msg, timeout=wait)
        return result

    def release_lease(self, lease_id: str, *, wait: bool = True) -> None:
        """Give a lease back. Idempotent; another client's lease is refused.

        ``wait=False`` does not wait for the daemon's OK (the connection keeps
        the order, so a later acquire is handled after it); a refusal is then
        only logged. ``lease()`` releases this way: one round trip per lease."""
        if wait:
            self.call(p.Release(id=0, lease_id=lease_id))
            return
        with self._cond:
            conn = self._conn
            if conn is None:
                return  # the lease died with the connection
            self._send(conn, p.Release(id=conn.next_id(), lease_id=lease_id, quiet=True))

    def report_oom(self, gpu: int | str = "gpu:0", task_type: str = "OTHER") -> None:
        """Count an out-of-memory error this process hit on ``gpu``."""
        self.call(p.ReportOom(id=0, gpu=gpu, task_type=task_type))

    def leases(self) -> p.LeasesReply:
        reply: p.LeasesReply = self.call(p.ListLeases(id=0))
        return reply

    def policies(self) -> dict[str, p.PolicyInfo]:
        reply: p.PoliciesReply = self.call(p.ListPolicies(id=0))
        return reply.policies

    def set_policy(self, task_type: str, **fields: Any) -> None:
        """Hot-update a task type's lease policy (admin)."""
        self.call(policy_msg(task_type, fields))

    # --- allocations ---------------------------------------------------------

    def allocate(
        self,
        task_id: str,
        gpus: float = 1,
        *,
        cpus: int = 0,
        prefer: list[int | str] | None = None,
        strategy: p.Strategy | str = p.Strategy.FIRST_FIT,
        tenant: str | None = None,
        priority: int | p.PriorityClass | str | None = None,
        wait_ms: int = 0,
        owner_pid: int | None = None,
    ) -> p.Allocated:
        """Assign GPUs and CPU cores to ``task_id`` (idempotent). Raises
        ProtocolError with code ``insufficient`` when the node cannot hold it
        (after waiting up to ``wait_ms`` in the priority queue)."""
        msg = allocate_msg(task_id, gpus, cpus, prefer, strategy, tenant, priority, wait_ms, owner_pid)
        reply: p.Allocated = self.call(msg, timeout=wait_ms / 1000 + self.request_timeout)
        return reply

    def release_allocation(self, task_id: str) -> None:
        self.call(p.Free(id=0, task_id=task_id))

    def allocations(self) -> p.AllocationsReply:
        reply: p.AllocationsReply = self.call(p.ListAllocations(id=0))
        return reply

    def reset_allocations(self) -> None:
        """Admin: release every allocation on the node."""
        self.call(p.ResetAllocations(id=0))

    def set_mode(self, mode: p.Mode | str, gpu: int | str | None = None) -> None:
        self.call(p.SetMode(id=0, mode=p.Mode(mode), gpu=gpu))

    def set_limits(
        self,
        client: int | str | None = None,
        *,
        core_limit: int | None = None,
        mem_limit: int | str | None = None,
        gpu: int | str | None = None,
    ) -> list[int]:
        """Change a client's limits (admin for another client's); the sessions changed."""
        reply: p.LimitsSet = self.call(
            p.SetLimits(id=0, client=client, gpu=gpu, core_limit=core_limit, mem_limit=size(mem_limit))
        )
        return reply.sessions

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
            self._cond.notify_all()
            self._idle_cond.notify_all()
        if conn is not None:
            conn.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sessions -----------------------------------------------------------

    def _enter_slice(self, s: Session) -> bool:
        with self._lock:
            if s.closed:
                raise GpudError("this session is closed")
            if s.in_slice:
                raise GpudError("slices of one session do not nest (an acquire() counts as one)")
            if s.mem_error is not None:
                err, s.mem_error = s.mem_error, None
                raise err
            s.in_slice = True  # claimed before waiting: a second thread cannot slip in
            if s.state == "holding":
                return True  # the lock is kept between slices: no round trip, no wait
        try:
            arbitrated = self._acquire(s)
        except BaseException:
            with self._lock:
                s.in_slice = False
            raise
        if not arbitrated:
            with self._lock:
                s.in_slice = False
        return arbitrated

    def _exit_slice(self, s: Session) -> None:
        if s.memory_probe is not None and (used := memory_to_report(s)) is not None:
            self._report_memory(s, used)
        with self._lock:
            s.in_slice = False
            if s.closed:
                return
            s.last_used = time.monotonic()
            release = s.state == "holding" and s.drop_pending is not None
            if not release:
                if s.idle_release is not None and s.last_used + s.idle_release < self._idle_wake_at:
                    self._idle_cond.notify()  # this lock goes idle before the idle thread would look
                return
            s.state = "releasing"
        self._give_back(s)

    def _acquire(self, s: Session) -> bool:
        """Block until ``s`` holds the lock. False: proceeding unarbitrated."""
        deadline: float | None = None
        with self._cond:
            while True:
                if s.error is not None:
                    err, s.error = s.error, None
                    raise err
                if s.state == "holding":
                    return True
                if self._closed or s.closed:
                    raise GpudError("the client or session is closed")
                if self._conn is not None and s.id == 0 and s.reattach_error is not None:
                    raise GpudError(f"the session could not be re-attached after a reconnect: {s.reattach_error}")
                if self._conn is None or s.id == 0:
                    deadline = deadline or time.monotonic() + self.unavailable_timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if self.proceed_unarbitrated:
                            log.warning("gpud unavailable: running a slice without the GPU lock")
                            return False
                        raise DaemonUnavailable(
                            f"gpud at {self.path} has been unreachable for {self.unavailable_timeout} s"
                        )
                    self._cond.wait(left)
                    continue
                if s.state == "idle":
                    conn = self._conn
                    s.state = "waiting"
                    # Only a refusal answers a LOCK_REQUEST (an Error with this
                    # id); the grant comes as a LOCK_OK push.
                    s.request_id = conn.next_id()
                    self._lock_requests[s.request_id] = s
                    try:
                        self._send(conn, p.LockRequest(id=s.request_id, session=s.id))
                    except DaemonUnavailable:  # the daemon died; the reader has not seen it yet
                        self._lock_requests.pop(s.request_id, None)
                        s.state = "idle"
                        if self._conn is conn:
                            self._conn = None  # wait for the reconnect, as when the reader saw it first
                        continue
                self._cond.wait()

    def _release(self, s: Session) -> None:
        with self._cond:
            s.in_slice = False
            if s.state != "holding":
                return
            s.state = "releasing"
        self._give_back(s)

    def _give_back(self, s: Session) -> None:
        """Synchronize, then LOCK_RELEASED. Called with s.state == 'releasing'."""
        if s.synchronize is not None:
            try:
                s.synchronize()
            except Exception:
                log.exception("synchronize hook failed; releasing the GPU lock anyway")
        with self._cond:
            if s.state != "releasing":  # revoked or reconnected meanwhile
                return
            conn = self._conn
            s.state = "idle"
            s.drop_pending = None
            self._cond.notify_all()
            if conn is not None and s.id:
                try:
                    self._send(conn, p.LockReleased(id=conn.next_id(), session=s.id, grant=s.grant))
                except DaemonUnavailable:
                    pass  # the reader reconnects; the lock died with the connection

    def _detach(self, s: Session) -> None:
        with self._cond:
            if s.closed:
                return
            s.closed = True
            sid, s.id = s.id, 0
            s.state, s.drop_pending = "idle", None
            self._sessions.pop(sid, None)
            if s in self._all:
                self._all.remove(s)
            self._cond.notify_all()
        if sid and self._conn is not None:
            try:
                self.call(p.Detach(id=0, session=sid))
            except GpudError:
                pass  # gone with the connection either way

    def _report_memory(self, s: Session, used_bytes: int) -> None:
        with self._cond:
            conn = self._conn
            if conn is None or not s.id:
                return  # reported again after the re-attach, at the next slice's end
            s.mem_reported = used_bytes
            self._send(conn, p.MemUpdate(id=conn.next_id(), session=s.id, used_bytes=used_bytes))



    def _bind(self, s: Session, reply: p.Attached) -> None:
        bind(s, reply)
        self._sessions[s.id] = s
        self.scheduler_on[reply.gpu] = reply.scheduler_on

    # --- the reader thread ------------------------------------------------------

    def _send(self, conn: Connection, msg: msgspec.Struct) -> None:
        with self._send_lock:
            conn.send(msg)

    def _require_conn(self) -> Connection:
        with self._cond:
            if self._closed:
                raise GpudError("the client is closed")
            if self._conn is None:
                raise DaemonUnavailable(f"not connected to gpud at {self.path} (reconnecting)")
            return self._conn

    def _open(self) -> None:
        conn = Connection(self.path)
        try:
            self.welcome = conn.hello(self.name, self.labels)
        except Exception:
            conn.close()
            raise
        self.scheduler_on = {g.index: g.scheduler_on for g in self.welcome.gpus}
        with self._cond:
            self._conn = conn

    def _read_loop(self) -> None:
        while True:
            conn = self._conn
            if conn is not None:
                try:
                    while True:
                        self._dispatch(conn.recv())
                except GpudError as exc:
                    self._lost(conn, exc)
            if not self._reconnect():
                return

    def _dispatch(self, msg: Any) -> None:
        with self._cond:
            match msg:
                case p.LockOk(session=sid, grant=g):
                    s = self._sessions.get(sid)
                    if s is not None:
                        self._lock_requests.pop(s.request_id, None)
                        granted(s, g, time.monotonic())
                case p.DropLock(session=sid, grant=g, reason=reason):
                    s = self._sessions.get(sid)
                    if s is None or s.state != "holding" or s.grant != g:
                        return
                    s.drops += 1
                    s.drop_pending = reason
                    if s.on_drop is not None:
                        self._call_hook(s.on_drop, reason)  # it may release() itself
                    if s.state == "holding" and not s.in_slice:
                        s.state = "releasing"
                        threading.Thread(target=self._give_back, args=(s,), daemon=True).start()
                case p.Revoked(session=sid, grant=g, reason=reason):
                    s = self._sessions.get(sid)
                    if s is not None:
                        revoked(s, g, reason)
                case p.LimitsChanged(session=sid, core_limit=core, mem_limit=mem):
                    s = self._sessions.get(sid)
                    if s is not None:
                        apply_limits(s, core, mem)
                case p.MemLimitExceeded(session=sid, used_bytes=used, limit_bytes=limit):
                    s = self._sessions.get(sid)
                    if s is not None:
                        s.mem_error = MemoryLimitExceeded(sid, used, limit)
                case p.LeaseResult(id=rid) if rid in self._abandoned:
                    self._abandoned.discard(rid)
                    if msg.acquired and msg.lease_id is not None and self._conn is not None:
                        self._send(self._conn, p.Release(id=self._conn.next_id(), lease_id=msg.lease_id))
                case p.LeaseRevoked(lease_id=lease_id, reason=reason):
                    log.warning("gpud released lease %s by force (%s)", lease_id, reason)
                    self.revoked_leases.add(lease_id)
                case p.Goodbye(reason=reason):
                    log.info("gpud is shutting down (%s); reconnecting when it is back", reason)
                case p.SchedState(gpu=gpu, on=on):
                    self.scheduler_on[gpu] = on
                case p.Error(id=rid) if rid is not None and rid in self._lock_requests:
                    sess = self._lock_requests.pop(rid)
                    sess.error = error_from(msg.code, msg.message)
                    if sess.state == "waiting":
                        sess.state = "idle"
                case p.Error(id=rid) if rid is not None and rid in self._pending:
                    target = self._pending[rid]
                    target.reply = msg
                    target.event.set()
                case p.Error():
                    log.warning("gpud reported %s: %s", msg.code, msg.message)
                case _ if getattr(msg, "id", None) in self._pending:
                    target = self._pending[msg.id]
                    target.reply = msg
                    target.event.set()
            self._cond.notify_all()

    @staticmethod
    def _call_hook(hook: Callable[[p.DropReason], None], reason: p.DropReason) -> None:
        try:
            hook(reason)
        except Exception:
            log.exception("on_drop callback failed")

    def _lost(self, conn: Connection, exc: GpudError) -> None:
        with self._cond:
            if self._conn is conn:
                self._conn = None
            self._lock_requests.clear()
            for pend in self._pending.values():
                pend.reply = DaemonUnavailable(f"lost connection to gpud at {self.path}: {exc}")
                pend.event.set()
            self._pending.clear()
            for s in self._sessions.values():
                s.state, s.drop_pending, s.id = "idle", None, 0
            self._sessions.clear()
            self._cond.notify_all()
        conn.close()
        if not self._closed:
            log.warning("lost connection to gpud: %s", exc)

    def _reconnect(self) -> bool:
        """Reconnect with backoff and re-attach every session. False: stop."""
        delay = _BACKOFF_START_S
        while True:
            with self._cond:
                if self._closed or not self.reconnect:
                    return False
            try:
                conn = Connection(self.path)
            except GpudError:
                with self._cond:
                    self._cond.wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            try:
                welcome = conn.hello(self.name, self.labels)
                attached = [(s, self._reattach(conn, s)) for s in list(self._all)]
            except GpudError:
                conn.close()
                with self._cond:
                    self._cond.wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            with self._cond:
                self.welcome = welcome
                self.scheduler_on = {g.index: g.scheduler_on for g in welcome.gpus}
                for s, reply in attached:
                    if isinstance(reply, ProtocolError):
                        s.reattach_error = reply
                        log.warning("gpud refused to re-attach a session on GPU %s: %s", s.gpu_ref, reply)
                    elif s.closed:  # closed while we were reconnecting
                        self._send(conn, p.Detach(id=conn.next_id(), session=reply.session))
                    else:
                        s.reattach_error = None
                        self._bind(s, reply)
                self._conn = conn
                self.reconnects += 1
                self._cond.notify_all()
            log.info("reconnected to gpud at %s; %d session(s) re-attached", self.path, len(attached))
            return True

    def _reattach(self, conn: Connection, s: Session) -> p.Attached | ProtocolError:
        try:
            reply: p.Attached = conn.call(msgspec.structs.replace(attach_msg(s), id=conn.next_id()))
        except ProtocolError as exc:  # e.g. its GPU is gone: the others still re-attach
            return exc
        return reply

    def _idle_loop(self) -> None:
        """Give back locks that no slice has used for ``idle_release`` s."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due: list[Session] = []
                wake: float | None = None
                for s in self._sessions.values():
                    if s.state != "holding" or s.idle_release is None:
                        continue
                    # in a slice now: it cannot go idle before idle_release from now
                    at = now + s.idle_release if s.in_slice else s.last_used + s.idle_release
                    if at <= now:
                        due.append(s)
                    else:
                        wake = at if wake is None else min(wake, at)
                for s in due:
                    s.state = "releasing"
                if due:
                    self._cond.release()
                    try:
                        for s in due:
                            self._give_back(s)
                    finally:
                        self._cond.acquire()
                    continue
                self._idle_wake_at = math.inf if wake is None else wake
                self._idle_cond.wait(None if wake is None else wake - now)
