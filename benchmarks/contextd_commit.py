"""Durable 128-page batch commit: through the daemon vs raw LMDB, side by side in one run.

`daemon_ms`: client -> Unix socket -> gRPC -> validation -> LMDB commit (sync full) -> reply, the
median over many batches of 128 new pages. `raw_lmdb_ms`: the same 128 records (same msgpack +
xxhash encoding, manifest and state-index rows) committed by py-lmdb directly in this process,
same sync mode, same filesystem. Batches alternate between the two so both see the same disk.

    python -m benchmarks.contextd_commit [--batches 300] [--sync full]

Last line: one JSON object with daemon_ms, raw_lmdb_ms, ratio and the spread of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdb

from benchmarks.stats import percentile
from contextd.client import pb
from contextd.keys import PageKey, StateKey
from contextd.store import encode
from contextd.wire import PageState
from serving.launcher import ContextdProcess

PAGES = 128


def batch(b: int) -> list[pb.Page]:
    return [pb.Page(page_id=f"b{b:06d}p{i:03d}", index=b * PAGES + i, token_start=(b * PAGES + i) * 128,
                    token_end=(b * PAGES + i + 1) * 128, original_position=(b * PAGES + i) * 128,
                    state=PageState.HOT.value, dtype="float32", layer_view="smollm2-135m/30x3x64")
            for i in range(PAGES)]


def raw_records(b: int) -> list[dict[str, object]]:
    return [{"page_id": p.page_id, "index": p.index, "token_start": p.token_start, "token_end": p.token_end,
             "original_position": p.original_position, "state": p.state, "locator": "", "byte_size": 0,
             "checksum": "", "dtype": p.dtype, "layer_view": p.layer_view, "block_id": "",
             "updated_unix": time.time(), "last_used_turn": 0} for p in batch(b)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--sync", default="full", choices=["full", "meta", "none"])
    args = parser.parse_args(argv)

    base = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "run" / "c.sock",
                             extra=["--sync", args.sync, "--reserve-bytes", "0"])
    client = daemon.start()
    env = lmdb.open(str(base / "raw"), map_size=1 << 32, max_dbs=4, sync=args.sync != "none",
                    metasync=args.sync == "full")
    manifest, state_index = env.open_db(b"kv_manifest"), env.open_db(b"page_state")
    daemon_ms: list[float] = []
    raw_ms: list[float] = []
    try:
        client.open_session("bench")
        warmup = 10
        for b in range(args.batches + warmup):
            pages = batch(b)
            start = time.perf_counter()
            client.upsert_pages("bench", pages)
            elapsed = (time.perf_counter() - start) * 1000
            records = raw_records(b)
            start = time.perf_counter()
            with env.begin(write=True) as txn:
                for page, record in zip(pages, records, strict=True):
                    txn.put(PageKey("bench", page.page_id).encode(), encode(record), db=manifest)
                    txn.put(StateKey("bench", PageState(page.state), page.page_id).encode(), b"", db=state_index)
            raw_elapsed = (time.perf_counter() - start) * 1000
            if b >= warmup:
                daemon_ms.append(elapsed)
                raw_ms.append(raw_elapsed)
        pages_stored = client.get_session("bench").pages.hot
    finally:
        daemon.stop()
        env.close()
        shutil.rmtree(base, ignore_errors=True)

    d, r = statistics.median(daemon_ms), statistics.median(raw_ms)
    print(f"{'path':<10} {'median ms':>10} {'p10':>8} {'p90':>8}   ({args.batches} durable batches of {PAGES} pages, "
          f"sync {args.sync})")
    print(f"{'daemon':<10} {d:>10.3f} {percentile(daemon_ms, 10):>8.3f} {percentile(daemon_ms, 90):>8.3f}")
    print(f"{'raw lmdb':<10} {r:>10.3f} {percentile(raw_ms, 10):>8.3f} {percentile(raw_ms, 90):>8.3f}")
    result = {"daemon_ms": round(d, 3), "raw_lmdb_ms": round(r, 3), "ratio": round(d / r, 3),
              "daemon_p90_ms": round(percentile(daemon_ms, 90), 3), "raw_lmdb_p90_ms": round(percentile(raw_ms, 90), 3),
              "batches": args.batches, "pages_per_batch": PAGES, "sync": args.sync, "pages_stored": pages_stored}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
