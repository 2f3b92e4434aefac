"""Where contextd keeps its root and its socket by default.

The root holds `db/` (LMDB), `store/` (payload files) and `contextd.lock`. The socket lives in a
folder of its own with mode 0700: `KV_ELISION_SOCKET` when set, else under
`$XDG_RUNTIME_DIR/kv-elision/` when that variable is set (a per-user, memory-backed folder), else
under `ROOT/run/`, ROOT being kv-elision's root: `kv-elision serve --root ROOT` keeps the data of
the contextd it starts under ROOT/contextd and that contextd's socket under ROOT/run/, and a
contextd started on its own takes ROOT as its data folder. `default_socket` is that rule, the one
place it is written in Python; the Pi extension's `socketPath` (extension/src/config.ts) is the
same rule, so its status line finds the server's contextd with no configuration
(extension/test/serve-socket.test.ts).

Everything under the root is private to the user (folders 0700, files 0600): the transcript in
LMDB and the K/V payloads are the user's source code. `private_folder` / `private_file` also
tighten what already exists (a root made beforehand by `mkdir -p`, which gives 0755). Depends on
nothing of ours.
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
    """The socket of the contextd for kv-elision's `root` (default_root() when None): the server's
    --root, never the contextd data folder under it."""
    explicit = os.environ.get("KV_ELISION_SOCKET")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kv-elision" / SOCKET_NAME
    return (root or default_root()) / "run" / SOCKET_NAME


def private_folder(folder: Path) -> Path:
    """Create `folder` (and its parents) 0700, or take group and other access from an existing one."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = folder.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(folder, mode & 0o700)
    return folder


def private_file(path: Path) -> None:
    """Take group and other access from an existing file."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


def target(socket_path: Path) -> str:
    return f"unix:{socket_path}"
