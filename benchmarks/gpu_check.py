"""What needs a GPU, in one run: the CUDA backend cases, then the restore and runtime benchmarks on CUDA.

    python -m benchmarks.gpu_check [--limit-s 480] [--json-out FILE]     (make gpu-check)

GPU time comes in minutes (docs/backends.md: "On a GPU machine"), so this is one prepared run
that fits in 8 by default: each part gets what is left of `--limit-s` (the tests first, since
they say whether the CUDA path is right at all; the benchmarks then say what it costs), and a
part that runs out of time is reported as such, with what it had printed. Parts:

- `backend_cases`: `pytest tests/backends -k cuda` (every backend test parametrised over
  devices has a CUDA case; on a machine without a GPU they all skip), counted from its JUnit XML;
- `restore`: `benchmarks.restore --device cuda` on a shorter session (restore next to recompute,
  the store next to dd), its headline figures;
- `runtime`: `benchmarks.runtime --runtimes torch --device cuda` (our torch backend next to
  transformers' generate on the same weights), its ratios.

Without CUDA it says so and exits 2 before running anything. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESTORE_ARGS = ["--device", "cuda", "--tokens", "8192", "--repeats", "7", "--recompute-repeats", "5"]
RESTORE_KEYS = ("restore_ms", "recompute_ms", "restore_over_recompute", "restore_warm_ms", "restore_k_ms",
                "historical_forward_during_restore", "accounting_exact", "device")
RUNTIME_ARGS = ["--runtimes", "torch", "--device", "cuda", "--prompt", "2048", "--decode", "256"]


def cuda_device() -> str | None:
    """The GPU's name, or None when torch sees none."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_part(argv: list[str], seconds: float) -> tuple[int | None, str]:
    """Run one part in the repository root; (exit status or None when it ran out of time, output)."""
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return None, out
    return done.returncode, done.stdout + done.stderr


def outcome(status: int | None) -> str:
    return "timed out" if status is None else ("ok" if status == 0 else f"exit {status}")


def last_json(output: str) -> dict[str, Any] | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def junit_counts(path: Path) -> dict[str, int]:
    """Cases run, failed, errored and skipped, from pytest's JUnit XML."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=480.0, help="wall-clock seconds for all parts together")
    parser.add_argument("--json-out", type=Path, help="also write the result here")
    args = parser.parse_args(argv)

    gpu = cuda_device()
    if gpu is None:
        print(json.dumps({"cuda": False, "why": "torch.cuda.is_available() is False: run this on a GPU machine"}))
        return 2
    deadline = time.monotonic() + args.limit_s
    result: dict[str, Any] = {"cuda": True, "gpu": gpu}
    failed = False
    with tempfile.TemporaryDirectory(prefix="kve-gpu-check-") as tmp:
        junit = Path(tmp) / "cases.xml"
        status, out = run_part([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/backends",
                                "-k", "cuda", f"--junitxml={junit}"], deadline - time.monotonic())
        cases: dict[str, Any] = junit_counts(junit) if junit.exists() else {}
        cases["status"] = outcome(status)
        if status != 0:
            cases["output_tail"] = out[-4000:]
            failed = True
        result["backend_cases"] = cases
    for name, module, extra, keys in (("restore", "benchmarks.restore", RESTORE_ARGS, RESTORE_KEYS),
                                      ("runtime", "benchmarks.runtime", RUNTIME_ARGS, None)):
        left = deadline - time.monotonic()
        if left < 30:
            result[name] = {"status": "no time left"}
            failed = True
            continue
        status, out = run_part([sys.executable, "-m", module, *extra], left)
        figures = last_json(out)
        part: dict[str, Any] = {"status": outcome(status)}
        if figures is not None:
            part.update({k: figures.get(k) for k in keys} if keys else figures)
        if status != 0 or figures is None:
            part["output_tail"] = out[-4000:]
            failed = True
        result[name] = part
    result["wall_s"] = round(args.limit_s - (deadline - time.monotonic()), 1)
    cases = result["backend_cases"]
    print(f"{gpu}: backend cases {cases.get('passed', 0)} passed, {cases.get('failures', 0)} failed, "
          f"{cases.get('errors', 0)} errors, {cases.get('skipped', 0)} skipped ({cases['status']})")
    for name in ("restore", "runtime"):
        print(f"  {name}: {result[name]['status']}")
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
