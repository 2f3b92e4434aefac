"""CLI transcripts: `contextd status | watch | gc | verify` against a real daemon."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from typing import IO

from contextd.client import pb
from contextd.wire import PageState, PinKind
from serving.launcher import ContextdProcess, stop_process
from tests.contextd.conftest import REPO, run_cli, states, store_payload


def _fill(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("alpha", model_id="smollm2-135m", budget_tokens=4096)
    records = [pb.Page(page_id=f"p{i}", token_start=i * 128, token_end=(i + 1) * 128) for i in range(6)]
    client.upsert_pages("alpha", records)
    store_payload(client, "alpha", records[0], b"k" * 2048)
    client.set_page_states("alpha", states([("p0", PageState.COLD)]))
    client.set_pins("alpha", add=[("p1", PinKind.SYSTEM)])
    client.write_record("alpha", pb.SessionRecord(turn=2, attention_tokens=640,
                                                  counters={"restored_pages": 3, "restored_pages_turn": 1}), 0, [])


def test_status_prints_a_table_and_json(daemon: ContextdProcess) -> None:
    _fill(daemon)
    table = run_cli("status", "--socket", str(daemon.socket))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("contextd pid ") and "sync full" in lines[0]
    assert lines[2].split() == ["SESSION", "TURN", "ATTN/BUDGET", "HOT", "COLD", "PINNED", "DROPPED", "CORRUPT",
                                "TOKENS", "h/c/p", "ON", "DISK", "SNAPSHOTS"]
    # hot counts every page in attention, the pinned one included
    assert lines[3].split() == ["alpha", "2", "640/4096", "5", "1", "1", "0", "0", "640/128/128", "2.0", "KiB", "0"]

    as_json = run_cli("status", "--json", "--socket", str(daemon.socket))
    data = json.loads(as_json.stdout)
    session = data["sessions"][0]
    assert session["pages"]["hot"] == "5" or session["pages"]["hot"] == 5  # uint64 is a string in proto JSON
    assert int(session["pages"]["bytes_on_disk"]) == 2048
    assert data["sync_mode"] == "full" and int(data["reserve_bytes"]) == 0


def test_watch_prints_one_line_per_change(daemon: ContextdProcess) -> None:
    _fill(daemon)
    proc = subprocess.Popen([sys.executable, "-m", "contextd.cli", "watch", "--socket", str(daemon.socket)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        first = _line_within(proc.stdout, 30)
        assert "alpha: hot 5 cold 1 pinned 1 | attn 640/4096 | restored 1 this turn, 3 in all" in first
        client = daemon.client
        assert client is not None
        client.set_pins("alpha", add=[("p2", PinKind.TOOLS)])
        second = _line_within(proc.stdout, 30)
        assert "hot 5 cold 1 pinned 2" in second
    finally:
        stop_process(proc, timeout=10)


def _line_within(stream: IO[str], seconds: float) -> str:
    """The next line `watch` prints, or a failure after `seconds`: a watcher that stays silent must
    not hold the test (and CI) open."""
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"contextd watch printed nothing in {seconds} s"
    return stream.readline()


def test_gc_removes_orphans_but_not_referenced_payloads(daemon: ContextdProcess) -> None:
    _fill(daemon)
    store = daemon.root / "store" / "alpha"
    orphan = store / "leftover.0000.kv"
    orphan.write_bytes(b"x" * 100)
    old = time.time() - 3600
    import os

    os.utime(orphan, (old, old))
    dry = run_cli("gc", "--dry-run", "--socket", str(daemon.socket))
    assert "would remove 1 orphan" in dry.stdout and orphan.exists()
    done = run_cli("gc", "--socket", str(daemon.socket))
    assert "removed 1 orphan and 0 temporary files (100 B)" in done.stdout, done.stdout
    assert not orphan.exists()
    assert run_cli("verify", "--socket", str(daemon.socket)).returncode == 0


def test_verbs_report_a_missing_daemon_clearly(tmp_path: object) -> None:
    result = run_cli("status", "--socket", "/tmp/kvd-no-such-daemon.sock")
    assert result.returncode == 2
    assert "not answering on /tmp/kvd-no-such-daemon.sock" in result.stderr
    assert "contextd serve" in result.stderr


def test_bad_sizes_and_sync_modes_are_usage_errors() -> None:
    assert run_cli("serve", "--reserve-bytes", "lots").returncode == 2
    assert "not a size" in run_cli("serve", "--quota-bytes", "12Q").stderr
    assert "invalid choice" in run_cli("serve", "--sync", "sometimes").stderr
