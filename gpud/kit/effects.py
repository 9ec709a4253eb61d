"""The one way the shell carries out what a core decided.

Every core returns its decisions as effects: the GPU schedulers (grants,
drops, revocations, lease answers), the allocation ledger (waiters served or
expired) and the health rules (probes, health changes). Each capability
registers a handler per effect type it answers for; ``carry_out`` runs them in
order. A fault in one effect is logged, counted and skipped, never the rest.
After a scheduler's effects the GPU's timer is re-armed if its next deadline
came earlier.

The schedulers serve both lock sessions and leases with the same effect types
(a ``Grant`` is a LOCK_OK or a LEASE_RESULT), so a handler registered for
leases takes an effect whose session is a lease.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from gpud.kit.faults import Faults
from gpud.kit.state import GpuSlot

Handler = Callable[[Any, int], None]  # (effect, now)


class Effects:
    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._handlers: dict[type, Handler] = {}
        self._lease_handlers: dict[type, Handler] = {}
        self._leases: Container[int] = ()
        self._after_answer: list[tuple[list[Any], int, GpuSlot | None]] = []

    def on(self, kind: type, handler: Handler) -> None:
        self._handlers[kind] = handler

    def on_lease(self, kind: type, handler: Handler) -> None:
        self._lease_handlers[kind] = handler

    def leases_are(self, leases: Container[int]) -> None:
        """The ids that are leases (the arbiter's live map): the others are sessions'."""
        self._leases = leases

    def after_answer(self, effects: Iterable[Any], now: int, slot: GpuSlot | None = None) -> None:
        """Carry these out once the request being handled has its answer sent (``run_after_answer``):
        a push they cause for something the answer makes known (a new session's PARK) must come after it."""
        self._after_answer.append((list(effects), now, slot))

    def run_after_answer(self) -> None:
        pending, self._after_answer = self._after_answer, []
        for effects, now, slot in pending:
            self.carry_out(effects, now, slot)

    def carry_out(self, effects: Iterable[Any], now: int, slot: GpuSlot | None = None) -> None:
        """Execute effects decided at ``now``; ``slot``: they are that GPU scheduler's."""
        for e in effects:
            kind = type(e)
            try:
                lease_handler = self._lease_handlers.get(kind)
                if lease_handler is not None and e.session in self._leases:
                    lease_handler(e, now)
                elif (handler := self._handlers.get(kind)) is not None:
                    handler(e, now)
                elif lease_handler is None:
                    raise LookupError(f"no handler for {kind.__name__}")
                # else: a lease's effect after the lease was forgotten: nobody to tell
            except Exception as exc:  # one effect's fault skips that effect, never the rest
                self.faults.record(
                    "effect",
                    exc,
                    gpu=None if slot is None else slot.gpu.index,
                    effect=kind.__name__,
                    session=getattr(e, "session", None),
                )
        if slot is not None:
            deadline = slot.scheduler.next_deadline()
            if deadline is not None and (slot.armed_for is None or deadline < slot.armed_for):
                slot.wake.set()  # only an earlier deadline needs the timer now; a later one it finds itself
