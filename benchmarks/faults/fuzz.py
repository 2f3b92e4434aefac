"""The campaign's fuzz part: malformed HTTP to a real server, slow clients, malformed gRPC and raw
bytes to its contextd; both must keep serving with bounded memory.

Depends on harness.faults, harness.procfs and serving.launcher.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.fuzz import SLOW_CLIENT_TIMEOUT_S, fuzz_grpc, fuzz_http, slow_clients
from harness.faults.oracle import CaseOutcome
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV
from harness.procfs import status_field


def run_fuzz_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                  ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    from serving.launcher import ServerProcess

    outcomes: list[CaseOutcome] = []
    server = ServerProcess(root=work / "fuzz-server", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2",
                                  "--client-timeout", str(SLOW_CLIENT_TIMEOUT_S)])
    with environ_set(CRASH_ENV, None), environ_set(IO_FAULT_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    assert server.proc is not None and server.contextd is not None and server.contextd.proc is not None
    pids = {"server": server.proc.pid, "contextd": server.contextd.proc.pid}
    try:
        warm = server.chat([{"role": "user", "content": "hello"}], session="warm", max_tokens=2)
        rss0 = {k: status_field(v, "VmRSS", gone=0) for k, v in pids.items()}
        threads0 = status_field(pids["server"], "Threads", gone=0)

        def alive() -> bool:
            return server.get("/health").status == 200

        log(f"fuzz: {args.fuzz_http} HTTP requests (server pid {pids['server']}, warm-up {warm.status})")
        http = fuzz_http(server.port, args.fuzz_http, alive=alive, auth=server.auth_headers())
        slow = slow_clients(server.port, auth=server.auth_headers())
        log(f"fuzz: {args.fuzz_grpc} gRPC calls and raw writes (contextd pid {pids['contextd']})")
        grpc_tally = fuzz_grpc(server.socket, args.fuzz_grpc)
        after = server.chat([{"role": "user", "content": "hello"}], session="warm-2", max_tokens=2)
        rss1 = {k: status_field(v, "VmRSS", gone=0) for k, v in pids.items()}
        crashes = sum(server.proc.poll() is not None or server.contextd.proc.poll() is not None for _ in [0])
        figures = {"fuzz_http": http.sent, "fuzz_grpc": grpc_tally.sent,
                   "fuzz_unclear": http.unclear_count + grpc_tally.unclear_count,
                   "fuzz_http_unclear": http.unclear_count, "fuzz_grpc_unclear": grpc_tally.unclear_count,
                   "crashes": crashes + int(after.status != 200),
                   "fuzz_rss_growth_mib": round(max(rss1[k] - rss0[k] for k in pids) / 1024, 1),
                   "fuzz_server_rss_mib": [round(rss0["server"] / 1024), round(rss1["server"] / 1024)],
                   "fuzz_contextd_rss_mib": [round(rss0["contextd"] / 1024), round(rss1["contextd"] / 1024)],
                   "fuzz_server_threads": [threads0, status_field(pids["server"], "Threads", gone=0)], **slow,
                   "fuzz_http_answers": dict(sorted(http.answered.items())),
                   "fuzz_grpc_answers": dict(sorted(grpc_tally.answered.items()))}
        for tally in (http, grpc_tally):
            for what, examples in tally.unclear.items():
                log(f"fuzz: {what}, e.g. {examples[0]!r}")
                outcome = CaseOutcome(what, "fuzz")
                outcome.fail(f"e.g. {examples[0]!r}")
                outcomes.append(outcome)
        if slow["slow_clients_let_go"] < slow["slow_clients"]:
            outcome = CaseOutcome("slow clients", "fuzz")
            outcome.fail(f"{slow['slow_clients'] - slow['slow_clients_let_go']} of {slow['slow_clients']} clients that "
                         "sent half a request still hold a server thread (no read timeout)")
            outcomes.append(outcome)
    finally:
        server.stop()
    return figures, outcomes
