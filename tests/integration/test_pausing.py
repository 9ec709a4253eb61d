"""A whole body as one slice that gpud may pause (``gpud_client.pausing``), against a real daemon.

The body is a loop of 3 ms "kernels" (sleeps) that always has work and never ends a slice of its
own, run in this process's main thread, as a Ray task's body is. The daemon's drop timeout is 1 s,
so a body that could not answer a DROP_LOCK for longer is revoked. Nothing here is timed: the
figures asserted hold on any machine (a body paused to a quarter share holds far less than all).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client, LockLost
from gpud_client.client import Session
from gpud_client.frameworks import torch_synchronize
from gpud_client.pausing import PAUSE_SIGNAL, PausableSlice

from .waiting import eventually

BODY_S = 2.5  # longer than the drop timeout, and five 0.5 s windows
KERNEL_S = 0.003


@pytest.fixture
def gpud(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory("--simulate", "1", "--window", "0.5", "--drop-timeout", "1", "--tq", "0.2")


@pytest.fixture
def quarter(gpud: DaemonProcess) -> Iterator[Session]:
    """A session limited to 25 % of the GPU's time, as a Ray task at num_gpus=0.25 is."""
    with Client(gpud.socket, name="body") as c:
        yield c.session(0, core_limit=25, idle_release=None)


def long_body(seconds: float = BODY_S, during: Callable[[], None] | None = None) -> float:
    """Kernels back to back for ``seconds``; the share of the time they ran. A pause may come at
    any bytecode, inside a kernel's own timing too, so a kernel counts as the 3 ms it asked for."""
    kernels = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        time.sleep(KERNEL_S)
        kernels += 1
        if during is not None:
            during()
    return kernels * KERNEL_S / (time.monotonic() - start)


def test_a_long_body_is_paused_to_its_share_and_ends_normally(quarter: Session) -> None:
    with PausableSlice([quarter]) as body:
        ran = long_body()
    assert body.pauses >= 2  # asked to yield at each used-up budget, and it did
    assert ran < 0.5  # a quarter, give or take the machine; unpaused it would be all of it
    assert quarter.revocations == 0 and quarter.drops >= body.pauses


def test_the_same_body_in_a_plain_slice_is_revoked(quarter: Session) -> None:
    """What a whole-body slice did before: it could not answer, and lost the lock after 1 s."""
    with pytest.raises(LockLost, match="lost the GPU lock"), quarter.slice():
        long_body()


def test_the_programs_own_handler_gets_the_signal_from_outside_and_is_put_back(quarter: Session) -> None:
    heard: list[int] = []

    def mine(signum: int, frame: object) -> None:
        heard.append(signum)

    previous = signal.signal(PAUSE_SIGNAL, mine)
    try:
        with PausableSlice([quarter]):
            assert signal.getsignal(PAUSE_SIGNAL) is not mine  # the body's pauses own it meanwhile
            os.kill(os.getpid(), PAUSE_SIGNAL)
            long_body(1.0)
        assert heard == [PAUSE_SIGNAL]
        assert signal.getsignal(PAUSE_SIGNAL) is mine
    finally:
        signal.signal(PAUSE_SIGNAL, previous)


def test_a_body_off_the_main_thread_is_a_plain_slice(quarter: Session) -> None:
    before = signal.getsignal(PAUSE_SIGNAL)
    seen: list[object] = []

    def run() -> None:
        with PausableSlice([quarter]) as body:
            seen.append(signal.getsignal(PAUSE_SIGNAL))
            long_body(0.3)  # under the drop timeout: answered at its end
        seen.append(body.pauses)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert seen == [before, 0]


def test_a_pause_never_happens_inside_the_client(quarter: Session) -> None:
    """The body calls the client while it runs (memory reports): a pause asked for then waits for
    the call to end, and the body still keeps to its share."""
    with PausableSlice([quarter]) as body:
        ran = long_body(during=lambda: quarter.report_memory(1 << 20))
    assert body.pauses >= 2 and ran < 0.5
    assert quarter.revocations == 0


def test_the_lock_is_free_for_others_while_the_body_is_paused(gpud: DaemonProcess, quarter: Session) -> None:
    with Client(gpud.socket, name="other") as other:
        neighbour = other.session(0, idle_release=None)
        granted = threading.Event()

        def one_slice() -> None:
            with neighbour.slice():
                granted.set()

        with PausableSlice([quarter]):
            t = threading.Thread(target=one_slice)
            t.start()
            long_body(during=lambda: None)
            assert granted.is_set()  # while the body was paused, not after it
        t.join(10)


class _FakeSession:
    """Enough of a sync Session for PausableSlice, without a daemon: its slice's entry can be made to
    bring a new DROP_LOCK at once, as a short time quantum does right after a grant."""

    def __init__(self) -> None:
        self.client = self
        self._lock = threading.RLock()
        self.on_drop: Callable[[object], None] | None = None
        self.drop_pending: str | None = None
        self.entries = 0
        self.redrop = 1  # drops that come with the next entries

    def slice(self) -> _FakeSession:
        return self

    def __enter__(self) -> _FakeSession:
        self.entries += 1
        if self.entries > 1 and self.redrop:  # re-granted, and asked to yield again at once: its hook
            self.redrop -= 1  # runs before the pause has ended (here, at once, in this very thread)
            self.drop_pending = "tq"
            assert self.on_drop is not None
            self.on_drop("tq")
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop_pending = None  # the lock is given back at the slice's end

    def drop(self, reason: str) -> None:
        self.drop_pending = reason
        assert self.on_drop is not None
        threading.Thread(target=self.on_drop, args=(reason,)).start()  # a hook thread, as the client's


def test_a_drop_that_comes_during_a_pause_is_answered_too() -> None:
    s = _FakeSession()
    with PausableSlice([s]) as body:  # type: ignore[list-item]
        s.drop("quota")
        eventually(
            lambda: body.pauses == 2 and s.drop_pending is None,
            "both drops answered",
            why=lambda: f"pauses {body.pauses}, pending {s.drop_pending}",
        )
    assert s.entries == 3


def test_each_pause_drains_the_gpu_work_on_the_bodys_own_thread(gpud: DaemonProcess) -> None:
    """The lock goes back only after synchronize, which for torch must run on the thread whose
    CUDA device it is: the body's own (a hook thread's current device is always the first)."""
    synced: list[tuple[int, bool]] = []

    class Cuda:
        def synchronize(self, device: int) -> None:
            synced.append((device, threading.current_thread() is threading.main_thread()))

    torch = type(os)("torch")
    torch.cuda = Cuda()  # type: ignore[attr-defined]
    with Client(gpud.socket, name="torchy") as c:
        s = c.session(0, core_limit=25, idle_release=None, synchronize=torch_synchronize(0, torch=torch))
        with PausableSlice([s]) as body:
            long_body(1.5)
    assert body.pauses >= 1 and synced[: body.pauses] == [(0, True)] * body.pauses


def test_a_drop_that_came_before_the_body_began_is_answered_too() -> None:
    s = _FakeSession()
    s.redrop = 0
    s.on_drop = lambda reason: None
    s.drop_pending = "tq"  # asked to yield between the grant and the body's first bytecode
    with PausableSlice([s]) as body:  # type: ignore[list-item]
        eventually(
            lambda: body.pauses == 1 and s.drop_pending is None,
            "the drop answered",
            why=lambda: f"pauses {body.pauses}, pending {s.drop_pending}",
        )
