"""What Linux's /proc says about the processes a test or benchmark started, and the machine.

The one place that reads /proc: a process's status lines (memory, threads) and CPU time, the
whole machine's CPU time, and which addresses listen on a TCP port. Depends on nothing of ours.
"""

from __future__ import annotations

import os
import resource
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


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one live process (/proc/PID/stat), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (servers and their contextd, once
    stopped): what a benchmark's own work took, for `other_cpu_share`."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, all cores summed, from /proc/stat
    (idle and iowait are not busy); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def other_cpu_share(before: tuple[float, float] | None, after: tuple[float, float] | None,
                    ours: float) -> float | None:
    """The share of all cores' time between two `machine_cpu_seconds()` readings that went to
    processes other than ours (`ours`: CPU seconds our own processes used meanwhile); None without
    /proc/stat. A benchmark run above a few percent measured contention as much as code."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, after[0] - before[0] - ours) / (after[1] - before[1])


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp and tcp6 write them) listening on TCP `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.append(address)
    return found


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie not yet reaped counts: it is not gone yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
