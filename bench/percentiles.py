"""The one percentile the benchmarks use: nearest rank, no interpolation."""

from __future__ import annotations

import math


def percentile(samples: list[float], pct: float) -> float:
    """Nearest rank: the smallest sample with at least pct % of samples at or below it."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]
