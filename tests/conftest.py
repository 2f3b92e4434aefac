"""The suite runs in parallel (`make test`: pytest-xdist, one worker per core): each worker, and
every server, daemon or Pi process a test starts, keeps to one compute thread, and the slow tests
are handed out first.

Why: on the 2-core machines CI and developers have, two workers with torch's default of one
thread per core each would ask for four; oversubscribed BLAS threads spin and wait for each
other, which made a parallel run slower than a serial one. Set before torch or numpy is imported
(this file loads first), so both the workers and the child processes they start read it.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.objectstore"]   # the `rgw` fixtures: a real S3 store for the object-tier tests

if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow end-to-end tests first: under xdist each starts while the fast ones fill the other
    workers around it, instead of one running alone at the end (measured: a 4-minute retrieval
    test collected mid-suite finished last, with the other worker idle)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
