"""The campaign's access part: a keyed server's checks, a pre-existing 0755 root, and another
local uid trying every route of a server on its default key (ROOT/api-key).

Depends on harness.faults and serving.launcher.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.access import access_checks, other_user_attempts, other_user_missing, precreated_root_checks
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
    other, problems = _other_user(work)
    for problem in problems:
        outcome = CaseOutcome("another uid", "access")
        outcome.fail(problem)
        outcomes.append(outcome)
    return {"access_checks": len(checks), "access_failures": len(failed), "other_user_denied": other}, outcomes


def _other_user(work: Path) -> tuple[dict[str, Any], list[str]]:
    """The uid `nobody` against a server that made its own key: every route but /health denied."""
    from serving.launcher import ServerProcess

    reason = other_user_missing()
    if reason:
        return {"routes": 0, "denied": 0, "skipped": reason}, []
    server = ServerProcess(root=work / "other-user" / "root", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2"])
    with environ_set(CRASH_ENV, None), environ_set(IO_FAULT_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start(timeout=300)
    try:
        secret = [{"role": "user", "content": "The vault code in src/vault.py is 4821. Remember it."}]
        if server.chat(secret, session="secret", max_tokens=2).status != 200:
            return {"routes": 0, "denied": 0}, ["the key's holder could not run a turn"]
        seen = other_user_attempts(server, "secret", "4821")
        turns = int(server.stats("secret")["counters"]["turns"])
    finally:
        server.stop()
    problems = seen.problems + ([f"a refused request ran a turn ({turns} turns)"] if turns != 1 else [])
    return seen.as_dict(), problems
