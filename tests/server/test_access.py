"""Who may use a server on loopback: the user who started it, not every local user.

`kv-elision serve` without --api-key makes a random key at its first start, in ROOT/api-key (mode
0600), and wants it on every route but a minimal /health. Another uid on the same machine (the
tests run as root; the other is `nobody`) is refused everywhere and cannot read the key; the Pi
extension of the server's own user finds the key by itself. A real `kv-elision serve` on the tiny
model, a real contextd, the real Pi.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from harness.faults.access import other_user_attempts, other_user_missing
from harness.pi import EXTENSION, PI_BIN, Pi, pi_env
from serving.launcher import ServerProcess

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
SECRET = {"role": "user", "content": "The vault code in src/vault.py is 4821. Remember it."}


def test_another_local_user_is_refused_on_every_route_and_cannot_read_the_key(server_factory: Any) -> None:
    reason = other_user_missing()
    if reason:
        pytest.skip(reason)
    server: ServerProcess = server_factory("tiny-llama", 1024)
    assert server.chat([SYSTEM, SECRET], session="secret", max_tokens=2).status == 200
    seen = other_user_attempts(server, "secret", "4821")
    assert not seen.problems, seen.problems
    assert seen.routes == seen.denied == 14 and seen.health_minimal and seen.key_file == "denied"
    assert server.stats("secret")["counters"]["turns"] == 1, "a refused request ran a turn"
    mode = (server.root / "api-key").stat()
    assert stat.S_IMODE(mode.st_mode) == 0o600 and mode.st_uid == os.getuid(), oct(mode.st_mode)


def test_the_key_is_made_once_private_and_replaced_when_others_could_read_it(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    key_file = server.root / "api-key"
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}x"}).status == 401
    assert server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status == 200
    assert server.get("/health").body["model"] == "tiny-llama", "the key's holder sees /health in full"
    server.stop()
    server.start()
    assert key_file.read_text().strip() == key, "a restart keeps the key its clients have"
    server.stop()
    os.chmod(key_file, 0o644)
    server.start()
    assert key_file.read_text().strip() != key, "a key others could read is replaced"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert server.get("/v1/models").status == 200


@pytest.mark.skipif(not PI_BIN.exists(), reason=f"Pi is not installed at {PI_BIN} (cd extension && npm ci)")
def test_pi_finds_the_key_of_a_server_on_its_default_root(server_factory: Any) -> None:
    """The user starts `kv-elision serve` and Pi with the extension, and types no key: the
    extension reads it from the root both default to (KV_ELISION_ROOT, else
    $XDG_STATE_HOME/kv-elision, as contextd resolves it)."""
    home = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    try:
        state = home / "state"
        server: ServerProcess = server_factory("tiny-llama", 1024, "--max-new-tokens", "8", start=False)
        server.root = state / "kv-elision"
        server.start()
        env = pi_env(PI_CODING_AGENT_DIR=str(home / "agent"), KV_ELISION_URL=f"http://127.0.0.1:{server.port}/v1",
                     KV_ELISION_SOCKET=str(server.socket), XDG_STATE_HOME=str(state), HOME=str(home))
        for told in ("KV_ELISION_API_KEY", "KV_ELISION_KEY_FILE", "KV_ELISION_ROOT"):
            env.pop(told, None)
        (home / "work").mkdir()
        pi = Pi(["--mode", "rpc", "--offline", "--no-session", "-e", str(EXTENSION), "--provider", "kv-elision",
                 "--model", "tiny-llama"], home / "work", env)
        try:
            _, timed = pi.prompt("Say hi.", timeout=300)
        finally:
            pi.close()
        replies = [e["message"] for _, e in timed if e.get("type") == "message_end"
                   and e["message"].get("role") == "assistant"]
        assert replies and all(not r.get("errorMessage") for r in replies), replies
        assert server.stats()["counters"]["turns"] >= 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
