"""Restoring a 128-token page from disk vs recomputing it, and block store throughput vs dd.

    python -m benchmarks.restore [--backend torch] [--device cpu] [--tokens 4096] [--page 128]

Setup: prefill `--tokens` tokens of real text (SmolLM2 by default), save the page in the middle
(tokens 2048..2175 for 4,096) as a block file, evict it. Then, interleaved so both see the same
machine state:

- restore (`restore_ms`, the headline): drop the block file from the page cache
  (posix_fadvise DONTNEED on the fsync'ed file, the call `dd iflag=nocache` makes), then read,
  checksum and decode the file, insert it at its place and re-anchor (`restore_block_file`; the
  torch backend streams it: 64 KiB reads on a background thread while the keys that have arrived
  are copied and rotated, committed only after the checksum verifies); the page is evicted again
  afterwards, untimed. `restore_warm_ms` is the same with the file in the page cache, i.e. a
  recently evicted page.
- recompute (`recompute_ms`): the page's 128 tokens through the model with the other 3,968 tokens
  held in attention (the page is appended through `prefill`, then evicted again, untimed).
- store write (`store_write_mbps`): save_block + `Block.to_file` (encode, temp file, fsync,
  rename, fsync of the directory). store read (`store_read_mbps`): the cold `Block.from_file`.
- dd, same file size, same directory, same 64 KiB request size as the store reader: write
  `dd if=<block file> of=X bs=64K conv=fsync`, read `dd if=X iflag=nocache count=0` (drops X from
  the page cache) then `dd if=X of=/dev/null bs=64K`; throughput from dd's own reported time (so
  process start-up is not counted against dd).

Also reported: the cost of a forced compaction of everything after the evicted page and of a
restore that then has to shift those keys up (`compact_ms`, `restore_shift_ms`), a check that the
restored keys equal the ones before eviction (`keys_max_abs_delta`), and the share of the
machine's CPU other processes used during the run (`other_processes_cpu_share`): on a shared
machine, a run above a few percent measured contention, not the code. Times are medians.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from backends import Backend, Block, load_backend
from backends.base import IO_CHUNK_BYTES, restore_block_file
from backends.corpus import sample_tokens


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_DD_TIME = re.compile(r"copied, ([0-9.eE+-]+) s")


def dd_seconds(args: list[str]) -> float | None:
    """Run dd and return the elapsed time it reports itself; None without a usable dd."""
    if shutil.which("dd") is None:
        return None
    out = subprocess.run(["dd", *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    m = _DD_TIME.search(out.stderr)
    if out.returncode != 0 or m is None:
        return None
    return float(m.group(1))


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) on Linux, else None.
    Their difference over the run is what other processes took: a contended run is reported as
    such instead of passing for a measurement."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    t = os.times()
    return busy / tick, t.user + t.system


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def mbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e6


def timed(be: Backend, fn: Callable[[], Any]) -> tuple[float, Any]:
    be.synchronize()
    t0 = time.perf_counter()
    out = fn()
    be.synchronize()
    return time.perf_counter() - t0, out


def compaction_costs(be: Backend, block_path: Path, start: int) -> tuple[float, float]:
    """Lazy gaps make the common restore rotate only its own page; this is what a forced compaction
    and then a restore into the closed gap (every later key shifted up) cost instead, on a fork."""
    fork = be.fork()
    compact_s, _ = timed(fork, fork.compact_positions)
    blk = Block.from_file(block_path, expect=fork.layer_view)
    shift_s, _ = timed(fork, lambda: fork.insert_block(blk, start))
    return compact_s, shift_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15, help="restore / store / dd repetitions")
    parser.add_argument("--recompute-repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="directory for block files (default: system temp)")
    args = parser.parse_args(argv)
    if args.tokens < 3 * args.page:
        parser.error("--tokens must be at least three pages")

    cpu0 = cpu_seconds()
    wall0 = time.perf_counter()
    t_load = time.perf_counter()
    be = load_backend(args.backend, args.model, device=args.device, dtype=args.dtype,
                      capacity=args.tokens + args.page)
    ids = sample_tokens(be.tokenizer, args.tokens)
    load_s = time.perf_counter() - t_load
    prefill_s, _ = timed(be, lambda: be.prefill(ids))

    start = (args.tokens // 2) // args.page * args.page
    end = start + args.page
    page_tokens = ids[start:end]
    reference_keys = be.rotated_keys(start, end)

    work = Path(tempfile.mkdtemp(prefix="kve-restore-", dir=args.dir))
    block_path = work / "page.kvblock"
    dd_path = work / "dd.bin"
    try:
        # Store write: the save path a pager runs before an eviction.
        write_s: list[float] = []
        block_bytes = 0
        for _ in range(args.repeats):
            s, block_bytes = timed(be, lambda: be.save_block(start, end).to_file(block_path))
            write_s.append(s)
        be.remove_attention_range(start, end)
        view = be.layer_view

        restore_cold: list[float] = []
        restore_warm: list[float] = []
        read_cold: list[float] = []
        recompute: list[float] = []
        keys_delta = 0.0
        for i in range(args.repeats):
            for cold in (True, False):
                if cold:
                    drop_from_page_cache(block_path)
                s, _ = timed(be, lambda: restore_block_file(be, block_path, start))
                (restore_cold if cold else restore_warm).append(s)
                if cold:
                    keys_delta = max(keys_delta, float(np.abs(be.rotated_keys(start, end) - reference_keys).max()))
                be.remove_attention_range(start, end)
            drop_from_page_cache(block_path)
            s, _ = timed(be, lambda: Block.from_file(block_path, expect=view))
            read_cold.append(s)
            if i < args.recompute_repeats:
                held = be.attention_tokens
                s, _ = timed(be, lambda: be.prefill(page_tokens))
                recompute.append(s)
                be.remove_attention_range(held, held + args.page)

        compact_s, shift_s = compaction_costs(be, block_path, start)

        dd_write: list[float] = []
        dd_read: list[float] = []
        for _ in range(args.repeats):
            w = dd_seconds([f"if={block_path}", f"of={dd_path}", f"bs={IO_CHUNK_BYTES // 1024}K", "conv=fsync"])
            dd_seconds([f"if={dd_path}", "iflag=nocache", "count=0"])
            r = dd_seconds([f"if={dd_path}", "of=/dev/null", f"bs={IO_CHUNK_BYTES // 1024}K"])
            if w is not None:
                dd_write.append(w)
            if r is not None:
                dd_read.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cpu1 = cpu_seconds()
    wall = time.perf_counter() - wall0
    other_cpu = None
    if cpu0 is not None and cpu1 is not None:
        other_cpu = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall / (os.cpu_count() or 1)
    counters = be.counters
    restore_ms = median_ms(restore_cold)
    recompute_ms = median_ms(recompute)
    result: dict[str, Any] = {
        "restore_ms": round(restore_ms, 3),
        "recompute_ms": round(recompute_ms, 3),
        "restore_over_recompute": round(restore_ms / recompute_ms, 5),
        "restore_warm_ms": round(median_ms(restore_warm), 3),
        "store_read_mbps": round(block_bytes / statistics.median(read_cold) / 1e6, 1),
        "store_write_mbps": round(block_bytes / statistics.median(write_s) / 1e6, 1),
        "dd_read_mbps": None if not dd_read else round(block_bytes / statistics.median(dd_read) / 1e6, 1),
        "dd_write_mbps": None if not dd_write else round(block_bytes / statistics.median(dd_write) / 1e6, 1),
        "block_bytes": block_bytes,
        "compact_ms": round(compact_s * 1e3, 3),
        "restore_shift_ms": round(shift_s * 1e3, 3),
        "keys_max_abs_delta": keys_delta,
        "historical_forward_during_restore": counters["historical_forward_during_restore"],
        "accounting_exact": counters["model_forward_tokens"]
        == counters["new_prefill_tokens"] + counters["decoded_tokens"],
        "backend": args.backend,
        "device": be.device,
        "model": be.model_name,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "page": args.page,
        "page_start": start,
        "repeats": args.repeats,
        "recompute_repeats": len(recompute),
        "prefill_tok_s": round(args.tokens / prefill_s, 1),
        "load_s": round(load_s, 1),
        "other_processes_cpu_share": None if other_cpu is None else round(other_cpu, 3),
    }
    rows = [
        ("restore, cold file (read+decode+insert+re-anchor)", f"{result['restore_ms']:.2f} ms"),
        ("restore, file in page cache", f"{result['restore_warm_ms']:.2f} ms"),
        (f"recompute {args.page} tokens with {args.tokens - args.page} in attention", f"{recompute_ms:.1f} ms"),
        ("restore / recompute", f"{100 * result['restore_over_recompute']:.2f} %"),
        ("forced compaction after the page", f"{result['compact_ms']:.2f} ms"),
        ("restore into a closed gap (shift later keys)", f"{result['restore_shift_ms']:.2f} ms"),
        ("block file", f"{block_bytes / 1e6:.2f} MB"),
        ("store write (save+encode+write+fsync+rename)", f"{result['store_write_mbps']} MB/s"),
        ("dd write (bs=64K conv=fsync)", f"{result['dd_write_mbps']} MB/s"),
        ("store read (cold read+decode+checksum)", f"{result['store_read_mbps']} MB/s"),
        ("dd read (bs=64K, after iflag=nocache)", f"{result['dd_read_mbps']} MB/s"),
        ("restored keys vs before eviction, max |delta|", f"{keys_delta:.3g}"),
        ("historical forward tokens during restore", str(result["historical_forward_during_restore"])),
        ("CPU taken by other processes during the run", "n/a" if other_cpu is None else f"{100 * other_cpu:.0f} %"),
    ]
    print(f"{args.backend} / {be.device} / {be.model_name} {args.dtype}, {args.tokens} tokens, page "
          f"{start}..{end - 1}, prefill {result['prefill_tok_s']} tok/s, files in {work.parent}")
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>12}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
