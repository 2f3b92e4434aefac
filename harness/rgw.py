"""A real S3 object store for tests and benchmarks: a throw-away single-node Ceph cluster (one mon,
one OSD on memstore, radosgw on loopback) from Debian's packages, in a folder of its own.

`make test` installs ceph-mon, ceph-osd and radosgw (Makefile: ceph). The scripts in harness/ceph
start one in seconds (no mgr, no cephx; each option is explained where it is set; timings:
docs/journal/2026-11-30-fault-campaign.md), stop it daemon by daemon, and restart radosgw alone,
which is how a test makes the object store go away and come back while the cluster keeps its
objects.

Dependency rules: the standard library and harness.procfs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness.procfs import process_cpu_seconds

__all__ = ["Rgw", "missing"]

SCRIPTS = Path(__file__).resolve().parent / "ceph"
ACCESS_KEY = "kv-elision-test"
SECRET_KEY = "kv-elision-test-secret"
DAEMONS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool")


def missing() -> str | None:
    """Why no RGW can start here (None: it can)."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (make ceph: Debian's ceph-mon, ceph-osd, radosgw)"
    if os.geteuid() != 0:
        return "a Ceph cluster is started as root here"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Rgw:
    """One cluster under `root`; `endpoint` and `environment` (the S3 credentials) once started.
    `objectstore` is the OSD's: memstore (objects in its RAM, at most 4 GiB; the tests') or
    bluestore (a sparse 10 GiB file under `root`; crash-safe, on disk, as a real store)."""

    def __init__(self, root: Path, objectstore: str = "memstore") -> None:
        if objectstore not in ("memstore", "bluestore"):
            raise ValueError(f"objectstore must be memstore or bluestore, not {objectstore!r}")
        self.root = root
        self.objectstore = objectstore
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def environment(self) -> dict[str, str]:
        """What a client process needs in its environment to reach the store (boto3 reads these)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def _run(self, script: str, *args: str, timeout: float = 180) -> str:
        done = subprocess.run([str(SCRIPTS / script), str(self.root), *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "RGW_OBJECTSTORE": self.objectstore})
        if done.returncode != 0:
            raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done.stdout

    def start(self) -> Rgw:
        self._run("rgw-up.sh", str(self.port), ACCESS_KEY, SECRET_KEY)
        return self

    def stop(self) -> None:
        """Every daemon of the cluster, radosgw first; the folder stays (the caller removes it)."""
        self._run("rgw-down.sh", timeout=60)

    def cpu_seconds(self) -> float:
        """CPU time the cluster's daemons have used (they are not this process's children: a
        benchmark adds them to its own work)."""
        return sum(process_cpu_seconds(int(path.read_text())) for path in (self.root / "run").glob("*.pid"))

    def kill_gateway(self) -> None:
        """SIGKILL radosgw: the object store stops answering; the cluster keeps its objects."""
        pid = int((self.root / "run" / "client.rgw.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    return
            except (OSError, IndexError):
                return
            time.sleep(0.02)
        raise RuntimeError(f"radosgw (pid {pid}) did not die")

    def restart_gateway(self) -> None:
        """radosgw again (after `kill_gateway`), waiting until S3 answers."""
        self._run("rgw-restart.sh", timeout=60)

