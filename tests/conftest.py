"""The suite runs in parallel (`make test`: pytest-xdist, one worker per core): each worker, and
every server, daemon or Pi process a test starts, keeps to one compute thread.

Why: on the 2-core machines CI and developers have, two workers with torch's default of one
thread per core each would ask for four; oversubscribed BLAS threads spin and wait for each
other, which made a parallel run slower than a serial one. Set before torch or numpy is imported
(this file loads first), so both the workers and the child processes they start read it.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = "1"
