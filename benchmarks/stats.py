"""The one percentile of the benchmarks' figures, and when a run's figures count.

Depends on nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


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


# Above this share of the machine's CPU taken by other processes, a run measured contention as
# much as code: its figures are printed, marked unreliable, and not quoted as results.
UNRELIABLE_OTHER_CPU = 0.10


def reliable(other_processes_cpu_share: float | None) -> bool:
    """Whether a run's figures count: the other processes' CPU share was measured and at most
    UNRELIABLE_OTHER_CPU (without /proc/stat it cannot be known, so it does not count)."""
    return other_processes_cpu_share is not None and other_processes_cpu_share <= UNRELIABLE_OTHER_CPU


def unreliable_warning(other_processes_cpu_share: float | None) -> str:
    """The line a benchmark prints above its figures when `reliable` is false."""
    if other_processes_cpu_share is None:
        return "UNRELIABLE: the CPU other processes took could not be measured (no /proc/stat)"
    return (f"UNRELIABLE: other processes took {other_processes_cpu_share:.0%} of the CPU during the run "
            f"(more than {UNRELIABLE_OTHER_CPU:.0%})")


def print_result(result: dict[str, Any], other_processes_cpu_share: float | None) -> None:
    """Add the other processes' CPU share and whether the run counts to `result`, warn when it
    does not, and print `result` as the benchmark's last line: one JSON object."""
    share = other_processes_cpu_share
    result["other_processes_cpu_share"] = None if share is None else round(share, 3)
    result["reliable"] = reliable(share)
    if not result["reliable"]:
        print(unreliable_warning(share))
    print(json.dumps(result))
