"""Access checks: socket and store modes, loopback binding, the API key, and a root that already
existed with the usual 0755.

Depends on harness.procfs and the campaign's processes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from harness.faults.processes import Daemon
from harness.procfs import listening_addresses


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


def access_checks(server: Any, key: str) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for the server on `server` (started with --api-key `key`)."""
    checks: list[tuple[str, bool, str]] = []

    def req(method: str, path: str, auth: str | None, body: Any = None) -> Any:
        headers = {"Authorization": auth} if auth is not None else {}
        return server.request(method, path, body, headers=headers, timeout=60)

    def is_openai_error(reply: Any) -> bool:
        error = reply.body.get("error") if isinstance(reply.body, dict) else None
        return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error

    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    health = req("GET", "/health", None)
    checks.append(("/health answers without a key", health.status == 200, str(health.status)))
    for path, method, body in [("/v1/models", "GET", None), ("/v1/kv/stats", "GET", None),
                               ("/v1/chat/completions", "POST", chat)]:
        for label, auth in [("no key", None), ("a wrong key", f"Bearer {key}x"), ("a bare key", key),
                            ("another scheme", f"Basic {key}")]:
            reply = req(method, path, auth, body)
            checks.append((f"{method} {path} with {label}: 401, OpenAI error body",
                           reply.status == 401 and is_openai_error(reply), f"{reply.status} {str(reply.body)[:120]}"))
        reply = req(method, path, f"Bearer {key}", body)
        checks.append((f"{method} {path} with the key: 200", reply.status == 200, f"{reply.status}"))
    turns = req("GET", "/v1/kv/stats", f"Bearer {key}").body["counters"]["turns"]
    checks.append(("a refused chat ran no turn", turns == 1, f"{turns} turns after one authorised chat"))
    addresses = listening_addresses(server.port)
    checks.append(("HTTP listens on loopback only", bool(addresses) and set(addresses) <= LOOPBACK, str(addresses)))
    sock = server.socket
    checks.append(("contextd socket is 0600", _mode(sock) == 0o600, oct(_mode(sock))))
    checks.append(("contextd socket folder is 0700", _mode(sock.parent) == 0o700, oct(_mode(sock.parent))))
    root = server.contextd.root
    checks.append(("contextd root is 0700", _mode(root) == 0o700, oct(_mode(root))))
    store = root / "store"
    payloads = [f for f in store.rglob("*") if f.is_file()]
    folders = [store, *[f for f in store.rglob("*") if f.is_dir()]]
    bad_files = [str(f.relative_to(root)) for f in payloads if _mode(f) & 0o077]
    bad_folders = [str(f.relative_to(root)) for f in folders if _mode(f) & 0o077]
    checks.append(("payload files are 0600", bool(payloads) and not bad_files,
                   f"{len(payloads)} files, {bad_files[:3]}"))
    checks.append(("store folders are 0700", not bad_folders, str(bad_folders[:3])))
    exposed = [f"{f.relative_to(root)} {oct(_mode(f))}" for f in root.rglob("*") if _mode(f) & 0o004]
    checks.append(("nothing under the contextd root is world-readable", not exposed, str(exposed[:4])))
    return checks


def precreated_root_checks(work: Path) -> list[tuple[str, bool, str]]:
    """A root that already existed with the usual 0755 (`mkdir -p ~/.local/state/kv-elision`):
    does contextd still keep the transcript (LMDB) and the payloads from other users?"""
    root = work / "precreated" / "root"
    root.mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    daemon = Daemon(root, work / "precreated.sock")
    daemon.start()
    try:
        daemon.client.open_session("s")
    finally:
        daemon.stop()
    readable = [f"{f.relative_to(root)} {oct(_mode(f))}" for f in [root, *root.rglob("*")]
                if _mode(f) & 0o004 and (f.is_file() or f == root)]
    reachable = _mode(root) & 0o005 == 0o005 and _mode(root / "db") & 0o005 == 0o005
    return [("a pre-existing 0755 root does not expose the transcript (db/data.mdb)",
             not (reachable and any("data.mdb" in r for r in readable)), str(readable[:4]))]
