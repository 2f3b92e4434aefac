"""Backend suite: the same tests for every runtime (see conftest.py)."""
