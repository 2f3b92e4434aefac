"""Where contextd keeps its root and its socket by default.

The root holds `db/` (LMDB), `store/` (payload files) and `contextd.lock`. The socket lives in a
folder of its own with mode 0700: under `$XDG_RUNTIME_DIR/kv-elision/` when that variable is set
(a per-user, memory-backed folder), else under `ROOT/run/`. Depends on nothing of ours.
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "contextd.sock"
# sockaddr_un.sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


def default_root() -> Path:
    explicit = os.environ.get("KV_ELISION_ROOT")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kv-elision"


def default_socket(root: Path | None = None) -> Path:
    explicit = os.environ.get("KV_ELISION_SOCKET")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kv-elision" / SOCKET_NAME
    return (root or default_root()) / "run" / SOCKET_NAME


def target(socket_path: Path) -> str:
    return f"unix:{socket_path}"
