"""Counters, gauges and histograms for the hot path: plain numbers, read at scrape.

prometheus_client's own metrics take a lock and walk a few layers per update
(~0.3 us an increment, ~0.8 us an observation, ~1 us more for ``labels()``);
gpud updates several per lock cycle from one thread. A cell here is a Python
number changed in place (``cell.value += 1``, a bucket count and a sum), and
each family is a collector that turns its cells into the usual series when
Prometheus scrapes. The scrape runs on the metrics server's thread: it copies
each cell under the GIL, so a histogram's count always equals its ``+Inf``
bucket; its sum may lag one observation behind, which Prometheus tolerates.

Families keep the ``labels(*values)`` call of prometheus_client, so a caller
looks a cell up once and keeps it. They export no ``_created`` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

C = TypeVar("C")


class CounterCell:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class GaugeCell:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class HistogramCell:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.sum += value


class _Family(Collector, Generic[C]):
    """One metric: its cells by label values, turned into samples when Prometheus scrapes."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._cells: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def _new(self) -> C:
        raise NotImplementedError

    def labels(self, *values: object) -> C:
        """The cell of these label values (made at the first call): look it up once, keep it."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes {len(self.labelnames)} label values, not {len(values)}")
        key = tuple(str(v) for v in values)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = self._new()
        return cell

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are created at once with their samples: nothing to check up front


class CounterCells(_Family[CounterCell]):
    def _new(self) -> CounterCell:
        return CounterCell()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, cell in list(self._cells.items()):
            family.add_metric(key, cell.value)
        yield family


class GaugeCells(_Family[GaugeCell]):
    def _new(self) -> GaugeCell:
        return GaugeCell()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, cell in list(self._cells.items()):
            family.add_metric(key, cell.value)
        yield family


class HistogramCells(_Family[HistogramCell]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must increase")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramCell:
        return HistogramCell(self.bounds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        for key, cell in list(self._cells.items()):
            counts, total = list(cell.counts), cell.sum
            running, buckets = 0, []
            for edge, n in zip(edges, counts):
                running += n
                buckets.append((edge, running))
            family.add_metric(key, buckets, total)
        yield family
