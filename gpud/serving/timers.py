"""The daemon's clocks: one timer task per GPU, one for the allocations.

A GPU's timer sleeps until its scheduler's next deadline or until something
changed, then carries out what the scheduler decided. A tick that cannot be
handled is logged, counted and skipped; only an inconsistent scheduler stops
the daemon.
"""

from __future__ import annotations

import trio

from gpud.kit.state import GpuSlot
from gpud.serving.server import Daemon


async def run_timer(daemon: Daemon, slot: GpuSlot) -> None:
    """Sleep until the scheduler's next deadline or until something changed. A tick
    that fails is logged, counted and skipped (then retried after a growing pause,
    never in a tight loop); a scheduler found inconsistent after it stops the daemon."""
    failures = 0
    while True:
        slot.wake = trio.Event()
        deadline = slot.armed_for = slot.scheduler.next_deadline()
        if deadline is None:
            await slot.wake.wait()
        else:
            delay = (deadline - daemon.now()) / 1e6
            if delay > 0:
                with trio.move_on_after(delay):
                    await slot.wake.wait()
        try:
            tick_gpu(daemon, slot, daemon.now())
            failures = 0
        except Exception as exc:
            daemon.faults.record("timer", exc, gpu=slot.gpu.index)
            slot.scheduler.check()
            failures += 1
            await trio.sleep(min(1.0, 0.01 * 2**failures))


async def run_allocations_timer(daemon: Daemon) -> None:
    """Expire allocation waits on time; reclaim allocations of dead owners."""
    next_reap = daemon.now()
    while True:
        daemon.allocations_wake = trio.Event()
        interval = daemon.config.reap_interval_s  # read each time: a reload changes it
        times = [t for t in (daemon.allocations.next_deadline(), next_reap if interval else None) if t is not None]
        if times:
            with trio.move_on_after(max(0.0, (min(times) - daemon.now()) / 1e6)):
                await daemon.allocations_wake.wait()
        else:
            await daemon.allocations_wake.wait()
        now = daemon.now()
        try:
            tick_allocations(daemon, now, reap=bool(interval) and now >= next_reap)
        except Exception as exc:  # the tick is skipped; the next one tries again
            daemon.faults.record("allocator", exc)
        if now >= next_reap:
            next_reap = now + round(interval * 1e6)


def tick_gpu(daemon: Daemon, slot: GpuSlot, now: int) -> None:
    """What one GPU's timer does when it wakes: carry out what its scheduler decides at ``now``."""
    daemon.effects.carry_out(slot.scheduler.advance(now), now, slot)


def tick_allocations(daemon: Daemon, now: int, *, reap: bool) -> None:
    """What the allocations' timer does when it wakes: expire waits; reclaim dead owners' allocations
    if ``reap`` (never while shutting down)."""
    daemon.allocations.advance(now)
    if daemon.shutting_down:
        return
    if reap:
        daemon.allocations.reap(now)
    elif daemon.allocations.reaping:  # the rest of a reap, a batch a turn
        daemon.allocations.reap_more(now)
