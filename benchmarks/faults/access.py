"""The campaign's access part: a keyed server's checks and a pre-existing 0755 root.

Depends on harness.faults and serving.launcher.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.access import access_checks, precreated_root_checks
from harness.faults.oracle import CaseOutcome
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV


def run_access_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                    ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    from serving.launcher import ServerProcess

    key = "kv-" + os.urandom(8).hex()
    server = ServerProcess(root=work / "access", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2", "--api-key", key])
    with environ_set(CRASH_ENV, None), environ_set(IO_FAULT_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        try:
            server.start(timeout=300)
            checks = access_checks(server, key)
        except RuntimeError as exc:
            checks = [("kv-elision serve --api-key starts", False, str(exc)[-300:])]
        finally:
            server.stop()
    checks += precreated_root_checks(work)
    outcomes = []
    for name, ok, detail in checks:
        outcome = CaseOutcome(name, "access")
        if not ok:
            outcome.fail(detail)
        outcomes.append(outcome)
    failed = [o for o in outcomes if not o.exact]
    log(f"access: {len(checks)} checks, {len(failed)} failed")
    return {"access_checks": len(checks), "access_failures": len(failed)}, outcomes
