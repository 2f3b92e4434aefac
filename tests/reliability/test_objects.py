"""The object-store tier's faults (benchmarks.faults part `objects`), on a real Ceph RGW
(tests/objectstore.py starts one, as root): a lost reply on every conditional PUT contextd makes
leaves no session stuck, and a server streaming sessions back through a store folder smaller
than a page reports no page corrupt and answers as a server on local disk. The campaign runs the
same machinery (harness.faults.objects), with more rounds of cache pressure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.faults.objects import cache_pressure, lost_replies, new_bucket
from harness.rgw import Rgw


@pytest.fixture
def credentials(rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rgw]:
    """The store's credentials in this process's environment, and so in every process it starts."""
    for name, value in rgw.environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KV_ELISION_API_KEY", raising=False)
    yield rgw


def test_a_lost_reply_on_every_conditional_put_leaves_no_session_stuck(credentials: Rgw, work: Path) -> None:
    found = lost_replies(work / "lost-replies", credentials, new_bucket(credentials))
    assert not found.problems, found.problems
    assert found.cases >= 12 and found.stuck == 0, found.as_dict()


def test_cache_pressure_while_sessions_stream_back_reports_nothing_corrupt(credentials: Rgw, work: Path) -> None:
    found = cache_pressure(work / "cache-pressure", credentials, new_bucket(credentials), rounds=2)
    assert not found.problems, found.problems
    assert found.cases == 2 and found.false_corrupt == 0 and found.fetched > 0, found.as_dict()
