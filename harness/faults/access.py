"""Access checks: socket and store modes, loopback binding, the API key, a root that already
existed with the usual 0755, and another local user trying every route of a server that wants
its key by default.

Depends on harness.procfs and the campaign's processes.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass, field
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


# Run as another uid: every route without the key (it cannot have it), then with the guess the
# Pi extension sends when it has none, then a read of the key file. Standard library only: the
# repository's interpreter lives under /root, which another user cannot enter.
OTHER_USER = r"""
import http.client, json, sys
port, key_file, session = int(sys.argv[1]), sys.argv[2], sys.argv[3]
chat = json.dumps({"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
routes = [("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/v1/kv/stats", None),
          ("GET", "/v1/kv/stats?session=" + session, None),
          ("GET", "/v1/kv/pages?session=" + session + "&text=1", None),
          ("GET", "/v1/kv/score?session=" + session, None), ("POST", "/v1/chat/completions", chat),
          ("POST", "/v1/kv/score", json.dumps({"session": session, "candidates": ["4821"]}))]
answers = []
for auth in ({}, {"Authorization": "Bearer kv-elision"}):
    for method, path, body in routes:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", "X-KV-Session": session,
                                                        **auth})
        reply = conn.getresponse()
        answers.append([method, path, bool(auth), reply.status, reply.read().decode(errors="replace")])
        conn.close()
try:
    open(key_file).read()
    key = "read"
except PermissionError:
    key = "denied"
except FileNotFoundError:
    key = "absent"
print(json.dumps({"answers": answers, "key": key, "uid": __import__("os").getuid()}))
"""
OTHER_USER_NAME = "nobody"


@dataclass
class OtherUser:
    """What another local uid got from a server: each route it tried (twice: without a key, and
    with the one the Pi extension sends when it has none), how many were denied (401 / 403
    without a word of the session), what /health told it, and whether it could read the key file."""

    routes: int = 0
    denied: int = 0
    health_minimal: bool = False
    key_file: str = ""
    uid: int = -1
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"routes": self.routes, "denied": self.denied, "health_minimal": self.health_minimal,
                "key_file": self.key_file}


def other_user_missing() -> str | None:
    """Why no other uid can be tried here (None: it can)."""
    if os.geteuid() != 0:
        return "trying another uid needs root"
    try:
        pwd.getpwnam(OTHER_USER_NAME)
    except KeyError:
        return f"no user {OTHER_USER_NAME!r}"
    return None if Path("/usr/bin/python3").exists() else "no /usr/bin/python3 for the other user"


def other_user_attempts(server: Any, session: str, secret: str) -> OtherUser:
    """Every route of `server` tried as the uid `nobody`: it may see /health's bare status, and
    nothing else (a route answers 401 or 403 without `secret` or `session` in its body); the key
    file must be unreadable to it. The server's root and its parent are opened to others first
    (0755), so that the key file's own mode is what keeps the other user out."""
    found = OtherUser()
    key_file = server.root / "api-key"
    for folder in (server.root.parent, server.root):
        os.chmod(folder, 0o755)
    nobody = pwd.getpwnam(OTHER_USER_NAME)
    run = subprocess.run(["/usr/bin/python3", "-c", OTHER_USER, str(server.port), str(key_file), session],
                         user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd="/",
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        found.problems.append(f"the other user's client failed: {run.stderr[-500:]}")
        return found
    seen = json.loads(run.stdout)
    found.uid, found.key_file = int(seen["uid"]), str(seen["key"])
    for method, path, guessed, status, body in seen["answers"]:
        if path == "/health":
            ok = status == 200 and json.loads(body) == {"status": "ok"}
            found.health_minimal = ok if not guessed else found.health_minimal and ok
            if not ok:
                found.problems.append(f"/health told the other user {status} {body[:120]}")
            continue
        found.routes += 1
        if status in (401, 403) and secret not in body and session not in body:
            found.denied += 1
        else:
            how = "a guessed key" if guessed else "no key"
            found.problems.append(f"{method} {path} ({how}): {status} {body[:120]}")
    if found.uid != nobody.pw_uid:
        found.problems.append(f"the client ran as uid {found.uid}, not {nobody.pw_uid}")
    if found.key_file != "denied":
        found.problems.append(f"the key file: {found.key_file}")
    return found
