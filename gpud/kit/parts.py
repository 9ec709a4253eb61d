"""What the server hands each capability that serves requests on the GPUs.

``Pieces`` is the set the lock, lease and allocation handlers all need: the
GPU slots, how a client's GPU reference resolves, the connections and the send
path, the one way to carry out effects, who may do what, and the metrics.
``Part`` keeps them as its own attributes (read on every request, so one
attribute hop, not two).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud.host.metrics import Metrics
from gpud.kit.access import Access
from gpud.kit.effects import Effects
from gpud.kit.links import Links
from gpud.kit.state import GpuRefs, GpuSlot, Handler


@dataclass(frozen=True, slots=True)
class Pieces:
    slots: list[GpuSlot]
    refs: GpuRefs
    links: Links
    effects: Effects
    access: Access
    metrics: Metrics


class Part:
    def __init__(self, pieces: Pieces) -> None:
        self.slots = pieces.slots
        self.refs = pieces.refs
        self.links = pieces.links
        self.effects = pieces.effects
        self.access = pieces.access
        self.metrics = pieces.metrics

    def handlers(self) -> dict[type, Handler]:
        """Message type -> the method that answers it."""
        raise NotImplementedError
