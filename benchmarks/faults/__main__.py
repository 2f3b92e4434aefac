"""`python -m benchmarks.faults`: the command line of the reliability campaign (the package's
docstring says what each part checks).

Depends on the campaign's parts and harness.faults.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import benchmarks.faults
from benchmarks.faults.access import run_access_part
from benchmarks.faults.connections import run_connections_part
from benchmarks.faults.crash import run_crash_part
from benchmarks.faults.fuzz import run_fuzz_part
from benchmarks.faults.hangs import run_hangs_part
from benchmarks.faults.objects import run_objects_part
from benchmarks.faults.report import print_table
from benchmarks.faults.sessions import run_sessions_part
from benchmarks.faults.storage import run_storage_part
from harness.faults.oracle import CaseOutcome
from harness.faults.processes import short_tempdir
from harness.faults.scenarios import SCENARIOS
from harness.faults.zygote import Zygote

PARTS = ("crash", "storage", "fuzz", "connections", "sessions", "access", "hangs", "objects")

PART_RUNNERS: dict[str, Callable[[argparse.Namespace, Path, Any, Callable[[str], None]],
                                 tuple[dict[str, Any], list[CaseOutcome]]]] = {
    "crash": run_crash_part,
    "storage": run_storage_part,
    "fuzz": run_fuzz_part,
    "connections": run_connections_part,
    "sessions": run_sessions_part,
    "access": run_access_part,
    "hangs": run_hangs_part,
    "objects": run_objects_part,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults",
                                     description=(benchmarks.faults.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--scenarios", default="llama,hybrid", help="crash and storage scenarios: llama,hybrid")
    parser.add_argument("--crash-points", type=int, default=220, help="crash cases to aim for (>= 200 for the issue)")
    parser.add_argument("--fuzz-http", type=int, default=10_000, help="malformed HTTP requests")
    parser.add_argument("--fuzz-grpc", type=int, default=10_000, help="malformed gRPC requests and raw socket writes")
    parser.add_argument("--http-crashes", type=int, default=1, help="also crash the real server over HTTP (0: no)")
    parser.add_argument("--session-trials", type=int, default=3, help="interleavings of 4 sessions (in-process)")
    parser.add_argument("--pressure-rounds", type=int, default=4,
                        help="objects: rounds of two sessions taking turns on one cache under cache pressure")
    parser.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, stores)")
    args = parser.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    work = short_tempdir("kvf-")
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    figures: dict[str, Any] = {}
    failures: dict[str, list[str]] = {}
    zygote: Zygote | None = None
    try:
        if {"crash", "storage", "sessions"} & set(parts):
            models = sorted({SCENARIOS[s].model for s in args.scenarios} | {"tiny-llama"})
            log(f"zygote: loading {', '.join(models)}")
            zygote = Zygote(models, work / "zygote.log")
        for part in parts:
            log(f"part {part}")
            t0 = time.monotonic()
            found, outcomes = PART_RUNNERS[part](args, work, zygote, log)
            figures.update(found)
            figures[f"{part}_s"] = round(time.monotonic() - t0, 1)
            failures[part] = [f"{o.scope} {o.label}: {'; '.join(o.problems)}" for o in outcomes if not o.exact]
    finally:
        if zygote is not None:
            zygote.close()
        if args.keep:
            log(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    figures["campaign_s"] = round(time.monotonic() - started, 1)
    print_table(figures, failures)
    line = json.dumps(figures, sort_keys=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
