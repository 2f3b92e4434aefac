"""Access (benchmarks.faults part 5): the API key (`kv-elision serve --api-key`), HTTP on loopback
only, the contextd socket and its folder private, payloads 0600 in 0700 folders, nothing of the
user's code readable by other local users."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.faults.access import access_checks, other_user_attempts, other_user_missing, precreated_root_checks
from harness.faults.processes import Daemon, environ_set
from harness.faults.scenarios import CRASH_ENV
from serving.launcher import ServerProcess

KEY = "kv-test-" + os.urandom(6).hex()


@pytest.fixture(scope="module")
def keyed(work: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(root=work / "keyed", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2", "--api-key", KEY])
    with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def checks(keyed: ServerProcess) -> dict[str, tuple[bool, str]]:
    return {name: (ok, detail) for name, ok, detail in access_checks(keyed, KEY)}


AUTH = ["/health answers without a key", "a refused chat ran no turn"] + [
    f"{method} {path} with {what}" for method, path in [("GET", "/v1/models"), ("GET", "/v1/kv/stats"),
                                                         ("POST", "/v1/chat/completions")]
    for what in ["no key: 401, OpenAI error body", "a wrong key: 401, OpenAI error body",
                 "a bare key: 401, OpenAI error body", "another scheme: 401, OpenAI error body", "the key: 200"]]


@pytest.mark.parametrize("name", AUTH)
def test_the_api_key(checks: dict[str, tuple[bool, str]], name: str) -> None:
    ok, detail = checks[name]
    assert ok, detail


@pytest.mark.parametrize("name", ["HTTP listens on loopback only", "contextd socket is 0600",
                                  "contextd socket folder is 0700", "contextd root is 0700",
                                  "payload files are 0600", "store folders are 0700"])
def test_private_by_default(checks: dict[str, tuple[bool, str]], name: str) -> None:
    ok, detail = checks[name]
    assert ok, detail


def test_a_precreated_root_does_not_expose_the_transcript(work: Path) -> None:
    [(name, ok, detail)] = precreated_root_checks(work)
    assert ok, detail


def test_nothing_under_the_contextd_root_is_world_readable(checks: dict[str, tuple[bool, str]]) -> None:
    ok, detail = checks["nothing under the contextd root is world-readable"]
    assert ok, detail


def test_a_root_left_readable_by_an_older_contextd_is_tightened_on_start(work: Path) -> None:
    root = work / "older" / "root"
    daemon = Daemon(root, work / "older.sock")
    daemon.start()
    daemon.client.open_session("s")
    daemon.stop()
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    daemon.start()
    try:
        daemon.client.status()
    finally:
        daemon.stop()
    exposed = [f"{p.relative_to(root)} {oct(p.stat().st_mode & 0o777)}" for p in [root, *root.rglob("*")]
               if p.stat().st_mode & 0o077]
    assert not exposed, exposed


def test_another_uid_is_denied_every_route_of_a_server_on_its_default_key(work: Path) -> None:
    """The campaign's other_user_denied, small: `nobody` tries every route, with no key and with
    the one the Pi extension guesses; every one but /health's bare status is denied."""
    reason = other_user_missing()
    if reason:
        pytest.skip(reason)
    server = ServerProcess(root=work / "default-key" / "root", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2"])
    with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    try:
        secret = [{"role": "user", "content": "The vault code in src/vault.py is 4821. Remember it."}]
        assert server.chat(secret, session="secret", max_tokens=2).status == 200
        seen = other_user_attempts(server, "secret", "4821")
        assert not seen.problems, seen.problems
        assert seen.routes == seen.denied == 14 and seen.health_minimal and seen.key_file == "denied"
        assert server.stats("secret")["counters"]["turns"] == 1
    finally:
        server.stop()
