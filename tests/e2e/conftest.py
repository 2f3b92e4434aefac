"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def llama_server_built() -> None:
    """Skips the test where llama-server is not built: it is never built by a test (about 20
    minutes on 2 cores), only by `python -m benchmarks.llamacpp` or `make compare`."""
    located = subprocess.run([sys.executable, "-m", "benchmarks.llamacpp", "--locate"], cwd=REPO,
                             capture_output=True, timeout=120)
    if located.returncode != 0:
        pytest.skip("llama-server is not built (python -m benchmarks.llamacpp, or make compare)")
