"""Allocations at scale: can one uid's many allocations stall the daemon? (bench/scale.py's ``allocs``)

What is measured, against real daemons started as scale.py starts its own (DAEMON_ARGS, the
state in a temporary directory), with a TOML file that lets this uid ask for production
priority, reaps dead owners every REAP_INTERVAL_S, gives a preempted holder GRACE_S (nothing
is taken back while it is measured) and raises the per-uid allocation caps to N + CAP_SLACK
(those of CAP_KEYS the daemon's config has), from this process on blocking connections:
- Making them: N fractional allocations (FRACTION of a GPU each, spot priority: a 2-GPU node
  holds 2 * PER_GPU), all owned by one child process of this one (``sleep``, named by
  ``owner_pid``), their ALLOCATEs pipelined on one connection, BATCH sent at once, then their
  answers read and checked: the seconds in all, the us per ALLOCATE of the last batch (made
  beside all the others), the longest loop turn meanwhile. So that a production request for a
  whole GPU must take back allocations of theirs, every GPU is full: when they all fit on GPU 0
  a production allocation made first holds GPU 1, and a spot "filler" (no owner) takes what
  they leave of the last GPU they reach.
- ALLOCS in a loop: for LIST_S, the whole listing asked again and again on another connection
  (page after page, ``after`` = the last ``next_after``, where ALLOCS pages; else one answer
  holding them all): each request's round trip p50 / p99 / max, a whole listing's p50, the
  longest loop turn meanwhile.
- All of one owner reaped at once: the owner killed and waited for (a zombie is alive to
  ``kill(pid, 0)``); the seconds from the kill until the daemon shows none of its allocations
  (the ``total`` of a one-allocation page where ALLOCS pages, else as many ``allocation_reaped``
  events in its log), which includes up to REAP_INTERVAL_S before the reaper looks.
- A preemption among them: N spot allocations again (a new owner: the first ones are gone),
  then a production request for one whole GPU, waiting: the ms from sending it to the first and
  to the last PREEMPT notice (read on the connection that holds the victims: every allocation on
  the GPU the first notice names).
In the last two, a probing client (a process of its own: a thread here would wait for this
one's GIL) sends STATUS on its own connection every PROBE_GAP_S, one at a time: the p50 / p99 /
max of the round trips under way in the window, which lasts at least MIN_WINDOW_S (a window too
short for a sample would have no figure), each one longer than PROBE_GAP_S standing also for
those the probe would have sent while it waited (see ``window``: one 100 s turn is not one slow
sample among hundreds of fast ones). A window's loop turn is the longest the daemon logged
in it ($GPUD_DEBUG_SLOW_TURN_MS = scale.py's SLOW_TURN_MS), None when none was that long; the
reaper's scan of every allocation, every REAP_INTERVAL_S, is part of the daemon and counts in
whichever window it falls.

The same scenario runs first with CONTROL allocations, on a daemon of its own (``_control``
keys): what the host and the daemon's fixed costs give. No alternation as scale.py's cycles
do: these figures are milliseconds and seconds, not microseconds that drift.

Targets (the issue's), at N: no loop turn over TURN_TARGET_MS, the probe's STATUS p99 at most
STATUS_TARGET_MS; printed beside the figures, never enforced, as scale.py's. Like scale.py it
aborts on an unexpected answer, and never touches a real GPU or a system daemon.

``python bench/scale_allocs.py probe SOCKET`` is the probing client (scale.py runs it).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpud.host.config import Config
from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.units import GPU_UNIT

from handoff import pin  # bench/, on the path when run as a script
from harness import progress
from percentiles import percentile

FRACTION = 0.0001  # of a GPU: the finest the protocol allows
PER_GPU = GPU_UNIT  # fractions of FRACTION one GPU holds
GPUS = 2  # the daemons' --simulate
CONTROL = 10
BATCH = 1000  # ALLOCATEs sent at once: their answers stay well under the daemon's outbox high-water mark
CAP_SLACK = 100
CAP_KEYS = ("max_allocations_per_uid", "max_allocation_waits_per_uid", "max_allocation_records_per_uid")
REAP_INTERVAL_S = 1.0
GRACE_S = 3600.0
LIST_S = 3.0
PROBE_GAP_S = 0.002
MIN_WINDOW_S = 0.2
POLL_S = 0.005  # between two looks at how many allocations are left
WAIT_S = 900.0  # one answer, or one reap: before the fix 20 000 were reaped in one 115 s loop turn
TURN_TARGET_MS = 10.0
STATUS_TARGET_MS = 20.0
DAY_MS = 86_400_000  # the protocol's longest wait_ms
SPOT, PRODUCTION = p.PriorityClass.SPOT, p.PriorityClass.PRODUCTION
TARGETS = {  # at N; making them has none
    "allocs_list_turn_ms_max": TURN_TARGET_MS,
    "allocs_reap_turn_ms_max": TURN_TARGET_MS,
    "allocs_reap_status_ms_p99": STATUS_TARGET_MS,
    "allocs_preempt_turn_ms_max": TURN_TARGET_MS,
    "allocs_preempt_status_ms_p99": STATUS_TARGET_MS,
}


@dataclass(frozen=True, kw_only=True)
class AllocsConfig:
    allocs: int = 2 * PER_GPU
    control: int = CONTROL
    list_s: float = LIST_S


# --- pure helpers -------------------------------------------------------------------


def allocs_toml(*, uid: int, caps: int, fields: set[str]) -> str:
    """This uid may ask for production; dead owners reaped every REAP_INTERVAL_S; the per-uid caps
    among ``fields`` (the daemon's config keys) raised to ``caps``."""
    lines = [
        f"reap_interval_s = {REAP_INTERVAL_S}",
        f"preemption_grace_s = {GRACE_S}  # nothing is taken back while it is measured",
        f'priority_max_uids = {{ "{uid}" = 100 }}  # the production request and filler',
    ]
    lines += [f"{key} = {caps}" for key in CAP_KEYS if key in fields]
    return "\n".join(lines) + "\n"


def layout(n: int) -> tuple[bool, tuple[int, float] | None]:
    """How a node is made full around ``n`` fractions (placed first fit): whether a production
    allocation holds GPU 1 first (they all fit on GPU 0), and the spot filler after them
    (GPU, share), None when they fill their last GPU."""
    if not 1 <= n <= GPUS * PER_GPU:
        raise ValueError(f"{n} fractions of {FRACTION} do not fit on {GPUS} GPUs")
    first = n <= PER_GPU
    left = (PER_GPU - n) if first else (GPUS * PER_GPU - n)
    return first, None if left == 0 else (0 if first else 1, left / PER_GPU)


def paged() -> bool:
    """Whether ALLOCS answers a page at a time (``after``/``limit``, ``next_after``/``total``)."""
    asked, answered = p.ListAllocations.__struct_fields__, p.AllocationsReply.__struct_fields__
    return "after" in asked and "limit" in asked and "next_after" in answered and "total" in answered


def window(
    samples: list[tuple[int, float]], start_ns: int, end_ns: int, gap_ms: float = PROBE_GAP_S * 1000
) -> dict[str, float]:
    """p50 / p99 / max of the round trips under way at some time between ``start_ns`` and ``end_ns``
    (one sent before a long loop turn and answered after it saw the turn), and how many were measured.
    A round trip longer than ``gap_ms`` also stands for the ones a client asking every ``gap_ms``
    would have sent while it waited, each waiting for the rest of it: rtt - gap, rtt - 2 gap, ...
    down to gap (HdrHistogram's correction for coordinated omission), else a probe stuck in one
    100 s turn would be one slow sample among hundreds of fast ones."""
    ms, measured = list[float](), 0
    for sent, rtt in samples:
        if sent > end_ns or sent + rtt * 1e6 < start_ns:
            continue
        measured += 1
        ms.append(rtt)
        stood_for = min(int(rtt // gap_ms) - 1, int((end_ns - sent) / 1e6 // gap_ms))  # sent by the end
        ms += [rtt - k * gap_ms for k in range(1, stood_for + 1)]
    return {"ms_p50": percentile(ms, 50), "ms_p99": percentile(ms, 99), "ms_max": max(ms), "samples": float(measured)}


def turn_max(turns: list[tuple[float, float, float]]) -> float | None:
    return max((t[0] for t in turns), default=None)


# --- talking to the daemon ----------------------------------------------------------


def expect(conn: Connection, kind: type, rid: int, timeout: float = WAIT_S) -> Any:
    """The answer to ``rid``, of ``kind`` (scale.py's phases use these too)."""
    msg = conn.recv(timeout)
    if not isinstance(msg, kind) or getattr(msg, "id", None) != rid:
        raise RuntimeError(f"expected {kind.__name__} for request {rid}, got {msg!r}")
    return msg


def connect(path: str, name: str) -> Connection:
    conn = Connection(path)
    conn.hello(name)
    return conn


def allocate(conn: Connection, requests: list[p.Allocate]) -> list[p.Allocated]:
    """The requests pipelined (sent at once), then their answers read: each one ALLOCATED."""
    codec = p.client_codec()
    conn.send_raw(b"".join(codec.encode(r) for r in requests))
    return [expect(conn, p.Allocated, r.id) for r in requests]


def list_all(conn: Connection) -> tuple[list[float], int]:
    """One whole listing: each request's round trip (ms), and how many allocations it listed."""
    ms: list[float] = []
    count, after = 0, None
    while True:
        rid = conn.next_id()
        t0 = time.monotonic_ns()
        conn.send(p.ListAllocations(id=rid, after=after) if paged() else p.ListAllocations(id=rid))
        reply = expect(conn, p.AllocationsReply, rid)
        ms.append((time.monotonic_ns() - t0) / 1e6)
        count += len(reply.allocations)
        after = getattr(reply, "next_after", None)
        if after is None:
            return ms, count


class Probe:
    """The probing client: ``python scale_allocs.py probe SOCKET``, STATUS round trips every PROBE_GAP_S
    until told to stop, then (sent at, round trip ms) for each, as JSON on its stdout."""

    def __init__(self, path: str) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "probe", path]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the STATUS probe did not start (exit {self.proc.wait()})")

    def stop(self) -> list[tuple[int, float]]:
        out, _ = self.proc.communicate("stop\n", timeout=WAIT_S)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the STATUS probe failed (exit {self.proc.returncode})")
        return [(int(sent), float(ms)) for sent, ms in json.loads(out)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def probe_main(path: str) -> int:
    conn = connect(path, "scale-allocs-probe")
    print("ready", flush=True)
    samples = []
    while not select.select([sys.stdin], [], [], PROBE_GAP_S)[0]:
        rid = conn.next_id()
        sent = time.monotonic_ns()
        conn.send(p.Status(id=rid))
        expect(conn, p.StatusReply, rid)
        samples.append((sent, (time.monotonic_ns() - sent) / 1e6))
    conn.close()
    print(json.dumps(samples), flush=True)
    return 0


def slow_turns(log_text: str) -> list[tuple[float, float, float]]:
    """The event-loop turns a daemon logged as slow, in order: (wall ms, the loop thread's CPU ms, of
    which in the garbage collector ms). Shared with scale.py, which re-exports it."""
    out = []
    for line in log_text.splitlines():
        if '"loop_turn_slow"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "loop_turn_slow":
            out.append((float(event["turn_ms"]), float(event["cpu_ms"]), float(event["gc_ms"])))
    return out


class LogTail:
    """A daemon's log from where it ended when made: each ``read`` the whole lines written since."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = os.path.getsize(path)

    def read(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next read
        self.offset += len(data)
        return data.decode(errors="replace")


# --- the scenario ---------------------------------------------------------------------


class AllocNode:
    """One daemon and what this process holds on it: the connection that makes (and holds, so is told
    of their preemption) the spot allocations, one that lists and counts them, one for production."""

    def __init__(self, n: int, cpus: set[int] | None, daemon_args: tuple[str, ...], fields: set[str]) -> None:
        self.n = n
        self.daemon = DaemonProcess(*daemon_args)
        self.toml = allocs_toml(uid=os.getuid(), caps=n + CAP_SLACK, fields=fields)
        config = os.path.join(self.daemon.workdir, "gpud.toml")
        with open(config, "w") as f:
            f.write(self.toml)
        self.daemon.args += ["--config", config]
        self.daemon.start()
        assert self.daemon.proc is not None
        self.conns: list[Connection] = []
        self.owners: list[subprocess.Popen[bytes]] = []
        self.gpu_of: dict[str, int] = {}  # every spot allocation -> its GPU
        try:
            if cpus is not None:
                pin(self.daemon.proc.pid, cpus)
            self.holder, self.lister, self.asker = (
                self.keep(connect(self.daemon.socket, f"scale-allocs-{role}"))
                for role in ("holder", "lister", "production")
            )
        except BaseException:
            self.close()
            raise

    def keep(self, conn: Connection) -> Connection:
        self.conns.append(conn)
        return conn

    def owner(self) -> subprocess.Popen[bytes]:
        """A child of this process to own allocations: of its lineage and uid, as the daemon asks."""
        proc = subprocess.Popen(["sleep", "86400"], stdin=subprocess.DEVNULL)
        self.owners.append(proc)
        return proc

    def tail(self) -> LogTail:
        return LogTail(str(self.daemon.log_path))

    def total(self) -> int:
        """How many allocations the daemon shows: a one-allocation page's ``total`` where ALLOCS pages."""
        rid = self.lister.next_id()
        self.lister.send(p.ListAllocations(id=rid, limit=1))
        reply = expect(self.lister, p.AllocationsReply, rid)
        return int(reply.total)

    def check_full(self) -> None:
        """Every GPU full: the production request cannot be served without taking some back."""
        rid = self.lister.next_id()
        self.lister.send(p.ListAllocations(id=rid, limit=1) if paged() else p.ListAllocations(id=rid))
        free = [g.free for g in expect(self.lister, p.AllocationsReply, rid).gpus]
        if any(free):
            raise RuntimeError(f"the GPUs should be full, but these shares are free: {free}")

    def close(self) -> None:
        for proc in self.owners:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        events = Counter(_event(line) for line in self.daemon.log().splitlines())
        self.daemon.cleanup()
        del events["loop_turn_slow"]
        if events:
            said = ", ".join(f"{name} x{count}" for name, count in events.most_common())
            progress(f"the daemon of {self.n} allocations logged: {said}")


def _event(line: str) -> str:
    try:
        return str(json.loads(line).get("event"))
    except (ValueError, AttributeError):
        return line[:200]


def fill_before(node: AllocNode) -> None:
    """Production on the whole of GPU 1 when the fractions all fit on GPU 0 (see ``layout``)."""
    if layout(node.n)[0]:
        rid = node.asker.next_id()
        ask = p.Allocate(id=rid, task_id="scale-fill-production", gpus=1, prefer=[1], priority_class=PRODUCTION)
        if allocate(node.asker, [ask])[0].gpus != [1]:
            raise RuntimeError("the production filler is not on GPU 1")


def fill_after(node: AllocNode) -> None:
    """The spot filler on what the fractions left of the last GPU they reached (see ``layout``)."""
    filler = layout(node.n)[1]
    if filler is not None:
        gpu, share = filler
        rid = node.holder.next_id()
        ask = p.Allocate(id=rid, task_id="scale-fill-spot", gpus=share, prefer=[gpu], priority_class=SPOT)
        node.gpu_of["scale-fill-spot"] = allocate(node.holder, [ask])[0].gpus[0]


def make(node: AllocNode, prefix: str) -> tuple[subprocess.Popen[bytes], dict[str, float | None]]:
    """N spot fractions owned by a new child, BATCH ALLOCATEs pipelined at a time."""
    owner, tail = node.owner(), node.tail()
    t0, last = time.monotonic(), 0.0
    for start in range(0, node.n, BATCH):
        asks = [
            p.Allocate(
                id=node.holder.next_id(),
                task_id=f"{prefix}{k}",
                gpus=FRACTION,
                priority_class=SPOT,
                owner_pid=owner.pid,
            )
            for k in range(start, min(node.n, start + BATCH))
        ]
        b0 = time.monotonic()
        for made in allocate(node.holder, asks):
            node.gpu_of[made.task_id] = made.gpus[0]
        last = (time.monotonic() - b0) / len(asks)
    took = time.monotonic() - t0
    return owner, {
        "make_s": took,
        "make_us_per_alloc": took / node.n * 1e6,
        "make_us_last_batch": last * 1e6,
        "make_turn_ms_max": turn_max(slow_turns(tail.read())),
    }


def list_loop(node: AllocNode, seconds: float, expected: int) -> dict[str, float | None]:
    """Whole listings, one after another, for ``seconds`` (at least one)."""
    tail, requests, whole = node.tail(), list[float](), list[float]()
    ends = time.monotonic() + seconds
    while not whole or time.monotonic() < ends:
        ms, count = list_all(node.lister)
        if count != expected:
            raise RuntimeError(f"ALLOCS listed {count} allocations, not {expected}")
        requests += ms
        whole.append(sum(ms))
    return {
        "list_ms_p50": percentile(requests, 50),
        "list_ms_p99": percentile(requests, 99),
        "list_ms_max": max(requests),
        "list_all_ms_p50": percentile(whole, 50),
        "list_pages": float(len(ms)),
        "list_turn_ms_max": turn_max(slow_turns(tail.read())),
    }


def reap(node: AllocNode, owner: subprocess.Popen[bytes], prefix: str, left: int) -> dict[str, float | None]:
    """Kill the owner (of the tasks named ``prefix``...); wait until only ``left`` allocations are
    shown, the probe sampling meanwhile."""
    tail, probe = node.tail(), Probe(node.daemon.socket)
    try:
        text, reaped = "", 0
        start = time.monotonic_ns()
        owner.kill()
        owner.wait()  # a zombie is alive to kill(pid, 0): the bench reaps its child, as a shell would
        while (node.total() if paged() else left + node.n - reaped) > left:
            if time.monotonic_ns() - start > WAIT_S * 1e9:
                raise RuntimeError(f"{node.n} allocations of a dead owner not reaped within {WAIT_S} s")
            time.sleep(POLL_S)
            text += (new := tail.read())
            reaped += new.count('"allocation_reaped"')
        done = time.monotonic_ns()
        time.sleep(max(0.0, MIN_WINDOW_S - (done - start) / 1e9))
        end = time.monotonic_ns()
        status = window(probe.stop(), start, end)
    finally:
        probe.kill()
    if (count := list_all(node.lister)[1]) != left:
        raise RuntimeError(f"{count} allocations left after the reap, not {left}")
    node.gpu_of = {t: g for t, g in node.gpu_of.items() if not t.startswith(prefix)}
    return {
        "reap_s": (done - start) / 1e9,
        "reap_turn_ms_max": turn_max(slow_turns(text + tail.read())),
        **{f"reap_status_{k}": v for k, v in status.items()},
    }


def preempt(node: AllocNode) -> dict[str, float | None]:
    """A production request for a whole GPU; the ms until the first and the last PREEMPT notice."""
    tail, probe = node.tail(), Probe(node.daemon.socket)
    try:
        start = time.monotonic_ns()
        ask = p.Allocate(
            id=node.asker.next_id(), task_id="scale-production", gpus=1, priority_class=PRODUCTION, wait_ms=DAY_MS
        )
        node.asker.send(ask)
        first = _notice(node.holder.recv(WAIT_S), node.gpu_of)
        first_ns = time.monotonic_ns()
        victims = {t for t, g in node.gpu_of.items() if g == first.gpus[0]}
        noticed = {first.task_id}
        while noticed != victims:
            noticed.add(_notice(node.holder.recv(WAIT_S), victims).task_id)
        last_ns = time.monotonic_ns()
        time.sleep(max(0.0, MIN_WINDOW_S - (last_ns - start) / 1e9))
        status = window(probe.stop(), start, time.monotonic_ns())
    finally:
        probe.kill()
    return {
        "preempt_first_ms": (first_ns - start) / 1e6,
        "preempt_last_ms": (last_ns - start) / 1e6,
        "preempt_victims": float(len(victims)),
        "preempt_turn_ms_max": turn_max(slow_turns(tail.read())),
        **{f"preempt_status_{k}": v for k, v in status.items()},
    }


def _notice(msg: Any, victims: dict[str, int] | set[str]) -> p.Preempt:
    if not isinstance(msg, p.Preempt) or msg.task_id not in victims or not msg.whole:
        raise RuntimeError(f"expected a PREEMPT notice of the whole of a spot allocation, got {msg!r}")
    return msg


def scenario(n: int, cfg: AllocsConfig, cpus: set[int] | None, daemon_args: tuple[str, ...]) -> dict[str, Any]:
    """Make, list, reap, make again, preempt, on a daemon of their own."""
    fields = set(Config.__struct_fields__)
    node = AllocNode(n, cpus, daemon_args, fields)
    try:
        fill_before(node)
        progress(f"allocs: making {n} allocations of {FRACTION} GPU, one owner, {BATCH} ALLOCATEs at a time")
        owner, figures = make(node, "a")
        fill_after(node)
        node.check_full()
        everything = len(node.gpu_of) + int(layout(n)[0])  # the spot ones and the production filler
        progress(f"allocs: {n} allocations: ALLOCS in a loop for {cfg.list_s} s")
        figures |= list_loop(node, cfg.list_s, everything)
        progress(f"allocs: {n} allocations: their owner killed, reaped (every {REAP_INTERVAL_S} s)")
        figures |= reap(node, owner, "a", everything - n)
        progress(f"allocs: {n} allocations again, of a new owner; a production request for a whole GPU")
        figures["remake_s"] = make(node, "b")[1]["make_s"]
        node.check_full()
        figures |= preempt(node)
        return {"figures": figures, "config": node.toml}
    finally:
        node.close()


def allocs_phase(cfg: AllocsConfig, cpus: set[int] | None, daemon_args: tuple[str, ...]) -> dict[str, Any]:
    return {
        "control": scenario(cfg.control, cfg, cpus, daemon_args),
        "subject": scenario(cfg.allocs, cfg, cpus, daemon_args),
    }


# --- the report --------------------------------------------------------------------------


def _round(key: str, value: float | None) -> float | None:
    if value is None:
        return None
    return round(value, 1 if ("_us_" in key or key.endswith(("_samples", "_victims", "_pages"))) else 3)


def allocs_report(
    phase: dict[str, Any], cfg: AllocsConfig, daemon_args: tuple[str, ...], slow_turn_ms: float
) -> dict[str, Any]:
    """Flat keys: ``allocs_<figure>`` at N, ``allocs_<figure>_control`` at CONTROL; the targets and
    whether they were met (a turn figure of None: no turn was even ``slow_turn_ms``, the daemons'
    $GPUD_DEBUG_SLOW_TURN_MS)."""
    subject, control = phase["subject"]["figures"], phase["control"]["figures"]
    flat = {f"allocs_{k}": _round(k, v) for k, v in subject.items()}
    flat |= {f"allocs_{k}_control": _round(k, v) for k, v in control.items()}
    return {
        "allocs_n": cfg.allocs,
        "allocs_control_n": cfg.control,
        **flat,
        "allocs_paged": paged(),
        "allocs_targets": TARGETS,
        "allocs_met": {k: _met(flat[k], limit) for k, limit in TARGETS.items()},
        "allocs_daemon": {"args": list(daemon_args), "config": phase["subject"]["config"]},
        "allocs_settings": {
            "fraction": FRACTION,
            "batch": BATCH,
            "list_s": cfg.list_s,
            "reap_interval_s": REAP_INTERVAL_S,
            "probe_gap_s": PROBE_GAP_S,
            "min_window_s": MIN_WINDOW_S,
            "slow_turn_ms": slow_turn_ms,
        },
    }


def _met(value: float | None, limit: float) -> bool:
    return value is None or value <= limit


_ROWS = [
    ("making them (s)", "make_s"),
    ("ALLOCATE, last batch (us each)", "make_us_last_batch"),
    ("longest loop turn, making (ms)", "make_turn_ms_max"),
    ("ALLOCS request p50 / p99 (ms)", "list_ms_p50", "list_ms_p99"),
    ("ALLOCS, whole listing p50 (ms)", "list_all_ms_p50"),
    ("longest loop turn, listing (ms)", "list_turn_ms_max"),
    ("reap: kill -> none shown (s)", "reap_s"),
    ("longest loop turn, reaping (ms)", "reap_turn_ms_max"),
    ("STATUS while reaping p50 / p99 (ms)", "reap_status_ms_p50", "reap_status_ms_p99"),
    ("preempt: first / last notice (ms)", "preempt_first_ms", "preempt_last_ms"),
    ("victims", "preempt_victims"),
    ("longest loop turn, preempting (ms)", "preempt_turn_ms_max"),
    ("STATUS while preempting p50 / p99 (ms)", "preempt_status_ms_p50", "preempt_status_ms_p99"),
]


def allocs_table(r: dict[str, Any]) -> str:
    slow = r["allocs_settings"]["slow_turn_ms"]

    def cell(key: str) -> str:
        return "-" if key not in r else f"< {slow:g}" if r[key] is None else f"{r[key]:g}"

    lines = [f"{'':<40}{r['allocs_control_n']:>22}{r['allocs_n']:>22}   target"]
    for label, *keys in _ROWS:
        control = " / ".join(cell(f"allocs_{k}_control") for k in keys)
        subject = " / ".join(cell(f"allocs_{k}") for k in keys)
        met = [k for k in (f"allocs_{k}" for k in keys) if k in r["allocs_targets"]]
        target = "".join(f"<= {r['allocs_targets'][k]:g} {'met' if r['allocs_met'][k] else 'NOT MET'}" for k in met)
        lines.append(f"{label:<40}{control:>22}{subject:>22}   {target}".rstrip())
    lines.append(
        f"(fractions of {FRACTION} GPU, one owner, spot; ALLOCS {'paged' if r['allocs_paged'] else 'in one answer'}; "
        f"'< {slow:g}': no loop turn that long; STATUS from a probe every {PROBE_GAP_S * 1000:g} ms)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] != ["probe"] or len(sys.argv) != 3:
        sys.exit("usage: scale_allocs.py probe SOCKET (scale.py runs it)")
    sys.exit(probe_main(sys.argv[2]))
