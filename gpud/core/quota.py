"""Compute limits: one shared window per GPU, one account per session.

Rules kept here:
- Window W per GPU; every account on the GPU shares its boundaries.
- A session's limit L (1-100; 100 = unlimited) buys W x L / 100 of GPU time
  per window. If the limits of the limited sessions (L < 100) on the GPU add
  up to more than 100, every budget is scaled by 100 / sum. Unlimited
  sessions take no part in that sum: they have no budget to scale.
- Concurrency-weighted billing: while k holders run together, each is billed
  wall time / k. Accounts are settled exactly at every change of the running
  set and at every window boundary, not sampled.
- Drop tail: between DROP_LOCK and LOCK_RELEASED a holder is billed at
  ``drop_tail_billing_percent`` of its weighted rate.
- Window reset: use above the budget, times ``carryover_percent`` / 100, is the
  next window's starting use; a session is throttled after the reset only if
  that carried use already reaches its budget.
- A limit change keeps the use of the current window: it never wipes usage.
  Use made before a budget shrank below it is not an overshoot: only what is
  billed beyond max(budget, that use) is carried into the next window, so a
  live limit change never turns past use into debt.

Use is kept in integer nanoseconds of weighted GPU time, so billing wall time
/ k loses at most 1 ns per settlement; time is integer microseconds like the
rest of the core. Nothing here reads a clock: every call takes ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

UNLIMITED = 100


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    window_us: int = 2_000_000
    carryover_percent: int = 100
    drop_tail_billing_percent: int = 100
    sample_interval_us: int = 50_000
    share_windows: int = 10


@dataclass(slots=True)
class Account:
    limit: int = UNLIMITED
    used_ns: int = 0
    running: bool = False
    tail: bool = False  # DROP_LOCK sent, LOCK_RELEASED not yet received
    throttled: bool = False
    throttles: int = 0
    floor_ns: int = 0  # use already made when the budget shrank below it this window
    carried_ns: int = 0  # the use this window started with
    history: deque[int] = field(default_factory=deque)  # use made in each finished window


class ComputeAccounts:
    """The accounts of one GPU. See the module comment for the rules."""

    def __init__(self, config: QuotaConfig, now: int) -> None:
        self.cfg = config
        self.window_start = now
        self._last = now
        self._acc: dict[int, Account] = {}
        self._limited_sum = 0
        self._limited: set[int] = set()  # accounts with a limit below 100: the only ones with budgets
        self._running: dict[int, Account] = {}  # billed now: a few, however many accounts there are

    # --- membership and state changes (each settles first) -------------------

    def add(self, sid: int, limit: int, now: int) -> None:
        self.settle(now)
        self._acc[sid] = Account(limit=limit, history=deque(maxlen=self.cfg.share_windows))
        if limit < UNLIMITED:  # an unlimited account moves no budget
            self._resum()

    def remove(self, sid: int, now: int) -> None:
        self.settle(now)
        limited = sid in self._limited
        del self._acc[sid]
        self._running.pop(sid, None)
        if limited:
            self._resum()

    def set_limit(self, sid: int, limit: int, now: int) -> None:
        self.settle(now)
        self._acc[sid].limit = limit  # use_ns is kept: a limit change never wipes usage
        self._resum()
        self._rethrottle()

    def start(self, sid: int, now: int) -> None:
        self.settle(now)
        a = self._acc[sid]
        a.running, a.tail = True, False
        self._running[sid] = a

    def stop(self, sid: int, now: int) -> None:
        self.settle(now)
        a = self._acc[sid]
        a.running, a.tail = False, False
        self._running.pop(sid, None)

    def begin_tail(self, sid: int, now: int) -> None:
        self.settle(now)
        self._acc[sid].tail = True

    def throttle(self, sid: int) -> None:
        a = self._acc[sid]
        if not a.throttled:
            a.throttled = True
            a.throttles += 1

    def reconfigure(self, config: QuotaConfig, now: int) -> None:
        """New knobs from here on; the current window keeps its start and its use."""
        self.settle(now)
        self.cfg = config

    # --- billing ------------------------------------------------------------

    def settle(self, now: int) -> bool:
        """Bill up to ``now``, crossing window boundaries. True if a window ended."""
        rolled = False
        W = self.cfg.window_us
        while now >= self.window_start + W:
            end = self.window_start + W
            self._bill(end)
            self._reset_window()
            self.window_start = end
            rolled = True
            if not self._running and not any(a.used_ns for a in self._acc.values()):
                # idle, nothing carried: the windows in between held no use
                skipped = (now - self.window_start) // W
                for a in self._acc.values():
                    a.history.extend([0] * min(skipped, self.cfg.share_windows))
                self.window_start += skipped * W
        self._bill(now)
        return rolled

    def _bill(self, t: int) -> None:
        elapsed = t - self._last
        self._last = t
        if elapsed <= 0:
            return
        running = self._running
        k = len(running)
        for a in running.values():
            pct = self.cfg.drop_tail_billing_percent if a.tail else 100
            a.used_ns += elapsed * 10 * pct // k  # elapsed us * 1000 ns * pct / 100 / k

    def _reset_window(self) -> None:
        carry = self.cfg.carryover_percent
        for sid, a in self._acc.items():
            a.history.append(a.used_ns - a.carried_ns)  # made in this window, not carried in
            budget = self.budget_ns(sid)
            floor, a.floor_ns = a.floor_ns, 0
            if budget is None:
                a.used_ns = a.carried_ns = 0
                a.throttled = False
                continue
            a.used_ns = a.carried_ns = max(0, a.used_ns - max(budget, floor)) * carry // 100
            a.throttled = a.used_ns >= budget

    def _resum(self) -> None:
        self._limited = {sid for sid, a in self._acc.items() if a.limit < UNLIMITED}
        total = sum(self._acc[sid].limit for sid in self._limited)
        if total == self._limited_sum:
            return  # an unlimited account came or went: no budget moved
        self._limited_sum = total
        for sid in self._limited:  # budgets may have shrunk below use already made
            a = self._acc[sid]
            budget = self.budget_ns(sid)
            if budget is not None and a.used_ns > budget:
                a.floor_ns = max(a.floor_ns, a.used_ns)

    def _rethrottle(self) -> None:
        """After budgets moved: throttle whoever is over, release whoever is not."""
        for sid, a in self._acc.items():
            budget = self.budget_ns(sid)
            if budget is None or a.used_ns < budget:
                a.throttled = False

    # --- questions ----------------------------------------------------------

    def budget_ns(self, sid: int) -> int | None:
        """This window's budget in ns of weighted GPU time; None = unlimited."""
        limit = self._acc[sid].limit
        if limit >= UNLIMITED:
            return None
        return self.cfg.window_us * 1000 * limit // max(100, self._limited_sum)

    def account(self, sid: int) -> Account:
        return self._acc[sid]

    def has(self, sid: int) -> bool:
        return sid in self._acc

    @property
    def has_limits(self) -> bool:
        """Some account has a limit below 100 (only those have budgets to run out)."""
        return bool(self._limited)

    def is_limited(self, sid: int) -> bool:
        return sid in self._limited

    def over_budget(self, sid: int) -> bool:
        budget = self.budget_ns(sid)
        return budget is not None and self._acc[sid].used_ns >= budget

    def exhausted(self) -> list[int]:
        """Running sessions, not already dropped, whose budget is used up."""
        acc = self._acc
        return [sid for sid in self._limited if acc[sid].running and not acc[sid].tail and self.over_budget(sid)]

    def next_deadline(self) -> int | None:
        """Exact exhaustion instants, window ends that matter, and the sample cap."""
        if not self._limited:
            return None  # nothing has a budget: nothing to watch
        times: list[int] = []
        window_end = self.window_start + self.cfg.window_us
        k = len(self._running)
        for sid in self._limited:
            a = self._acc[sid]
            budget = self.budget_ns(sid)
            if budget is None:
                continue
            if a.throttled:
                times.append(window_end)  # unthrottled at the reset
            if a.running:
                times.append(window_end)
                times.append(self._last + self.cfg.sample_interval_us)
                remaining = budget - a.used_ns
                if not a.tail and remaining > 0:
                    # wall time until remaining is billed at 1/k: ceil(remaining * k / 1000)
                    times.append(self._last + -(-remaining * k // 1000))
        return min(times, default=None)

    def recent_share(self, sid: int) -> float:
        """Share of the GPU over the last finished windows, in percent."""
        h = self._acc[sid].history
        if not h:
            return 0.0
        return 100.0 * sum(h) / (len(h) * self.cfg.window_us * 1000)
