"""One process's figures from Linux's /proc/PID/status, for benchmarks that watch a server they started.

Depends on nothing of ours.
"""

from __future__ import annotations

from pathlib import Path


def status_field(pid: int, name: str, gone: int | None = None) -> int:
    """The integer value of the `name:` line of /proc/PID/status ("VmRSS" in kB, "Threads"), 0 when
    the line is missing. A process that is gone raises OSError, or gives `gone` when one is given."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        if gone is None:
            raise
        return gone
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0
