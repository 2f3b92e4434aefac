"""Restores from each tier of a contextd whose durable tier is an object store, next to recomputing.

    python -m benchmarks.tiers [--model smollm2-135m] [--tokens 12288] [--budget 4096]
                               [--handover-tokens 131072]

Setup: a real single-node Ceph RGW (harness/rgw.py; as root, with `make ceph`) keeping its objects
on disk (bluestore), a real contextd on it (`--object-store`), and the real engine (SmolLM2 in
float32 by default) reading a session of `--tokens` tokens with a `--budget`-token budget, so most
pages are cold; every payload went up to the object store before its page left attention. Then,
interleaved so all see the same machine:

- local-cache hit (`restore_local_ms`): the server's restore of one cold page
  (`PageMover.execute`, as benchmarks.restore) whose file is in the store folder (dropped from the
  page cache first);
- miss (`restore_remote_ms`): the same with the folder's copy removed, so the restore's GetPages
  downloads it from the object store (checksum checked, fsynced, renamed into place) first, then
  the restore reads the file it just wrote;
- recompute (`recompute_ms`): the page's 128 tokens through the model with the session's
  attention held.

Then a handover: the same engine reads a second session of `--handover-tokens` tokens and
answers one more question in it (`unmoved_turn_s`, the session resident), and the next question
goes to a second server: another contextd on another root sharing the bucket, and an engine with
an empty cache of the same weights. `handover_s` is that turn from request to answer (one token):
taking the session over (holder, state, transcript), restoring its resident pages from the object
store, prefilling the question; `handover_bytes` what that server downloaded.

`restore_over_recompute_local` / `_remote` are the headline ratios; `mbps_local` / `_remote` the
payload rate of each tier's restore; `bytes_moved` what crossed to and from the object store in
the run (both contextds' status). Medians; p95 beside them. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from backends import load_backend
from benchmarks.restore import Restorer, build_session, median_ms
from benchmarks.stats import percentile, print_result
from contextd.client import Client
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from harness.rgw import Rgw, missing
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.heap import freeze_loaded_heap
from serving.launcher import ContextdProcess
from serving.paging import rewind
from serving.turn import ChatRequest, TurnResult


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--handover-tokens", type=int, default=131072)
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        parser.error(f"no object store to measure: {reason}")
    machine0, own0 = machine_cpu_seconds(), own_cpu_seconds()
    work = Path(tempfile.mkdtemp(prefix="kvb-tiers-", dir="/tmp"))
    rgw = Rgw(work / "ceph", "bluestore").start()
    os.environ.update(rgw.environment)
    url = f"s3://bench-{uuid.uuid4().hex[:10]}"
    daemon = ContextdProcess(work / "root", work / "c.sock", extra=[
        "--reserve-bytes", "0", "--object-store", url, "--object-endpoint", rgw.endpoint])
    try:
        daemon.start()
        client = Client(daemon.socket)
        backend = load_backend("torch", args.model, capacity=args.budget + 256)
        engine = Engine(backend, ChatFormat(backend.tokenizer), client,
                        EngineConfig(budget_tokens=args.budget, max_new_tokens=1,
                                     tail_tokens=min(512, args.budget // 4)))
        freeze_loaded_heap()   # as `kv-elision serve` does once it has loaded the model
        session, _ = build_session(engine, args.tokens)
        restorer = Restorer(engine, session, daemon.root / "store")
        restorer.timed(restorer.cold[-8:], cold=False)   # warm-up: the slot buffers grow once
        page = restorer.cold[len(restorer.cold) // 2]
        info = session.pager.pages[page]
        page_tokens = session.transcript.ids[info.token_start:info.token_end]
        scratch = backend.fork()
        local: list[float] = []
        remote: list[float] = []
        recompute: list[float] = []
        for _ in range(args.repeats):
            local.append(restorer.timed([page], cold=True))
            restorer.files([page])[0].unlink()          # the folder's copy goes: the next restore fetches it
            # (not cold=True: asking for the file's path to drop it from the page cache would fetch it untimed)
            remote.append(restorer.timed([page], cold=False))
            held = scratch.attention_tokens
            started = time.perf_counter()
            scratch.prefill(page_tokens)
            recompute.append(time.perf_counter() - started)
            rewind(scratch, held)
        block_bytes = restorer.files([page])[0].stat().st_size
        counters = backend.counters
        handover = hand_over(engine, work, list(daemon.extra), args.handover_tokens)
        status = client.status()
    finally:
        store_cpu = rgw.cpu_seconds()   # the object store's work is the run's own, not another process's
        daemon.stop()
        rgw.stop()
        shutil.rmtree(work, ignore_errors=True)
    other = other_cpu_share(machine0, machine_cpu_seconds(), own_cpu_seconds() + store_cpu - own0)
    recompute_ms = median_ms(recompute)
    result: dict[str, Any] = {
        "model": args.model, "session_tokens": session.transcript.tokens, "budget_tokens": args.budget,
        "block_bytes": block_bytes, "recompute_ms": round(recompute_ms, 2),
        "restore_local_ms": round(median_ms(local), 2), "restore_local_ms_p95": round(percentile(local, 95) * 1e3, 2),
        "restore_remote_ms": round(median_ms(remote), 2),
        "restore_remote_ms_p95": round(percentile(remote, 95) * 1e3, 2),
        "restore_over_recompute_local": round(median_ms(local) / recompute_ms, 4),
        "restore_over_recompute_remote": round(median_ms(remote) / recompute_ms, 4),
        "mbps_local": round(block_bytes / median_ms(local) / 1e3, 1),
        "mbps_remote": round(block_bytes / median_ms(remote) / 1e3, 1),
        "bytes_moved": status.bytes_uploaded + status.bytes_fetched + handover["handover_bytes"],
        "objects_uploaded": status.objects_uploaded, "objects_fetched": status.objects_fetched,
        **handover,
        "historical_forward_during_restore": counters.historical_forward_during_restore,
    }
    print(f"{args.model}: a {session.transcript.tokens}-token session, {len(restorer.cold)} cold pages of "
          f"{block_bytes / 1e6:.1f} MB in a Ceph RGW at {rgw.endpoint}")
    for name, tier in (("local-cache hit", "local"), ("from the store", "remote")):
        print(f"  restore, {name:<16}: {result[f'restore_{tier}_ms']} ms "
              f"({100 * result[f'restore_over_recompute_{tier}']:.2f}% of recompute, {result[f'mbps_{tier}']} MB/s)")
    print(f"  recompute 128 tokens     : {recompute_ms:.1f} ms")
    print(f"  handover of a {handover['handover_session_tokens']}-token session: {handover['handover_s']} s "
          f"({handover['handover_bytes'] / 1e6:.0f} MB fetched; the same turn unmoved {handover['unmoved_turn_s']} s)")
    print_result(result, other)
    return 0


def hand_over(engine: Engine, work: Path, contextd_args: list[str], tokens: int) -> dict[str, Any]:
    """A `tokens`-token session read on `engine`, one turn there, the next on a second server."""
    _, messages = build_session(engine, tokens, "handover")

    def turn(server: Engine, question: str) -> tuple[float, TurnResult]:
        messages.append({"role": "user", "content": question})
        started = time.perf_counter()
        final = None
        for event in server.chat(ChatRequest("handover", list(messages), max_tokens=1)):
            final = event.final or final
        assert final is not None
        messages.append({"role": "assistant", "content": final.content})
        return time.perf_counter() - started, final

    unmoved_s, _ = turn(engine, "Which module did the notes describe first?")
    other = ContextdProcess(work / "root-b", work / "b.sock", extra=contextd_args)
    other.start()
    try:
        client = Client(other.socket)
        second = Engine(engine.backend.fork(), engine.format, client, engine.config)
        handover_s, final = turn(second, "And which one came last?")
        status = client.status()
        counters = second.sessions["handover"].counters
    finally:
        other.stop()
    return {"handover_session_tokens": final.prompt_tokens, "handover_s": round(handover_s, 3),
            "unmoved_turn_s": round(unmoved_s, 3), "handover_bytes": status.bytes_fetched,
            "handover_pages_fetched": status.objects_fetched, "handover_prefilled_tokens": final.prefilled_tokens,
            "handover_adoptions": counters.adoptions,
            "handover_historical_forward": counters.historical_forward_during_restore}


if __name__ == "__main__":
    raise SystemExit(main())
