"""A real S3 object store for the suites that need one (a pytest plugin, loaded by tests/conftest.py):
single-node Ceph RGW clusters started by harness/rgw.py (`make test` installs Debian's ceph-mon,
ceph-osd and radosgw), and a fresh bucket per test."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextd.objects import ObjectStore, ObjectStoreConfig
from harness.rgw import Rgw, missing


def _cluster() -> Iterator[Rgw]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    store = Rgw(folder / "ceph").start()
    yield store
    store.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def rgw() -> Iterator[Rgw]:
    """One cluster for a module's tests; never restarted (see own_rgw)."""
    yield from _cluster()


@pytest.fixture
def own_rgw() -> Iterator[Rgw]:
    """A cluster of the test's own, for a test that kills its gateway (a bucket made right after a
    gateway restart took ~28 s here, so a shared cluster is never restarted)."""
    yield from _cluster()


def bucket(rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """A fresh bucket of the test's own and a client on it; the test's environment (and so every
    process it starts) gets the store's credentials."""
    for name, value in rgw.environment.items():
        monkeypatch.setenv(name, value)
    store = ObjectStore(ObjectStoreConfig(url=f"s3://t-{uuid.uuid4().hex[:12]}", endpoint=rgw.endpoint))
    store.ensure_bucket()
    return store
