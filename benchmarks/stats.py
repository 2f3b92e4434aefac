"""The one percentile of the benchmarks' figures.

Depends on nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile of `values`, q in percent (0 to 100: 50 is the median, 95 the p95),
    linearly interpolated between the two closest ranks (numpy's default method). Empty values
    raise ValueError."""
    if not values:
        raise ValueError("the percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q is in percent, 0 to 100, got {q}")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
