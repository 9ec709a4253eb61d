"""The hot-path metric cells read as prometheus_client's own metrics do at scrape."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpud.host.cells import CounterCells, GaugeCells, HistogramCells

BUCKETS = (0.001, 0.01, 0.1)


def test_a_histogram_cell_scrapes_as_prometheus_clients_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    cells = HistogramCells("gpud_x_seconds", "x", ["gpu"], ours, buckets=BUCKETS)
    reference = Histogram("gpud_x_seconds", "x", ["gpu"], registry=theirs, buckets=BUCKETS)
    for value in (0.0005, 0.001, 0.005, 0.1, 0.2, 3.0):  # on a bound counts in it (le)
        cells.labels(0).observe(value)
        reference.labels(0).observe(value)
    for suffix in ("_count", "_sum"):
        assert ours.get_sample_value(f"gpud_x_seconds{suffix}", {"gpu": "0"}) == pytest.approx(
            theirs.get_sample_value(f"gpud_x_seconds{suffix}", {"gpu": "0"})
        )
    for le in ("0.001", "0.01", "0.1", "+Inf"):
        sample = {"gpu": "0", "le": le}
        assert ours.get_sample_value("gpud_x_seconds_bucket", sample) == theirs.get_sample_value(
            "gpud_x_seconds_bucket", sample
        ), le
    assert ours.get_sample_value("gpud_x_seconds_bucket", {"gpu": "0", "le": "0.001"}) == 2


def test_counter_and_gauge_cells_scrape_with_their_labels() -> None:
    registry = CollectorRegistry()
    grants = CounterCells("gpud_y_total", "y", ["gpu", "reason"], registry)
    waiting = GaugeCells("gpud_z", "z", ["gpu"], registry)
    cell = grants.labels(1, "quota")
    cell.inc()
    cell.value += 2  # what the hot path does with a kept cell
    assert grants.labels(1, "quota") is cell  # looked up once, kept
    waiting.labels(0).inc()
    waiting.labels(0).inc()
    waiting.labels(0).dec()
    text = generate_latest(registry).decode()
    assert 'gpud_y_total{gpu="1",reason="quota"} 3.0' in text and "# TYPE gpud_y_total counter" in text
    assert 'gpud_z{gpu="0"} 1.0' in text and "_created" not in text


def test_a_cell_family_refuses_the_wrong_number_of_labels() -> None:
    cells = CounterCells("gpud_w_total", "w", ["gpu"], CollectorRegistry())
    with pytest.raises(ValueError, match="takes 1 label values, not 2"):
        cells.labels(0, "extra")
    with pytest.raises(ValueError, match="buckets must increase"):
        HistogramCells("gpud_v_seconds", "v", ["gpu"], CollectorRegistry(), buckets=(0.1, 0.01))
