"""Restoring pages the way the server does, next to recomputing them; the store next to dd.

    python -m benchmarks.restore [--backend torch] [--device cpu] [--tokens 12288] [--budget 4096]

Setup: a real contextd process and the real engine (SmolLM2 by default) read a session of
`--tokens` tokens of real text with a `--budget`-token attention budget, so most pages are cold
in the canonical store. The process's heap is frozen once the model is loaded, as `kv-elision
serve` does (serving.heap). Then, interleaved so both see the same machine state:

- restore (`restore_ms`, the headline): the server's own restore, `PageMover.execute` with a
  decision that brings one cold page back: the manifest record is looked up by id in contextd,
  the page's file (dropped from the page cache first, with posix_fadvise DONTNEED on the fsync'ed
  file, the call `dd iflag=nocache` makes) is streamed into free cache slots, verified against
  its manifest checksum and re-anchored, and the page's new state and lease are recorded in
  contextd. The page is evicted again afterwards, untimed. `restore_warm_ms`: the same with the
  file in the page cache (a recently evicted page), right after that page's cold restore.
  `restore_k_ms`: k = 1, 8 and 32 cold pages in one decision, the in-turn cost of a selector's
  plan; `restore_warm_k_ms`: the same k pages again after those rounds, their files in the page
  cache, as a session switch or a recovery restores what was resident a moment ago. A decision
  sends one state commit to contextd whatever its k, so the warm payload rate of k pages
  (`restore_warm_k_mbps`) shows what that one round trip costs a single page.
- compressed (`restore_compressed_ms`): the same page stored again with `--compress zstd`
  (byte planes + zstd, one frame per layer; `compression_ratio`, `bytes_per_token` with and
  without), restored the same way from a cold file.
- recompute (`recompute_ms`): the page's 128 tokens through the model with the session's
  attention held (prefilled on a scratch fork of the session's cache, then rewound, untimed).
- store write (`store_write_mbps`): the server's store of one resident page, `PageMover.store`:
  save_block, the canonical store's durable write (writev of the block's buffers, checksum while
  writing, fsync, rename, fsync of the folder) and the page's manifest record.
- dd, same file size and 64 KiB requests, in the store's folder: `dd conv=fsync` for the write,
  `iflag=nocache` then a read for the read, timed by dd itself; and a read of the file then in
  the page cache in 1 MiB requests, the rate the kernel copies a warm page out at, which a warm
  restore is set against (`restore_warm_over_dd_cached_read`: 1.0 = as fast as that copy alone).

Also reported: the share of the machine's CPU other processes used during the run
(`other_processes_cpu_share`): on a shared machine, a run above a few percent measured
contention, not the code; above 10% `reliable` is false and a line above the table says so.
Times are medians. Last line: one JSON object.
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
from pathlib import Path
from typing import Any

from backends import Block, load_backend
from backends.blockfile import IO_CHUNK_BYTES
from benchmarks.stats import reliable, unreliable_warning
from contextd.client import Client, pb
from contextd.wire import PageState
from controller.pager import Decision
from harness.corpus import SAMPLE_TEXT
from harness.procfs import machine_cpu_seconds, other_cpu_share, process_cpu_seconds
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.heap import freeze_loaded_heap
from serving.launcher import ContextdProcess
from serving.paging import rewind
from serving.session import Session
from serving.turn import ChatRequest

K_PAGES = (1, 8, 32)


def _torch_threads(backend: str) -> int | None:
    """The intra-op threads the recompute ran on (the restore runs on one, see backends.torch.backend)."""
    if backend != "torch":
        return None
    import torch

    return int(torch.get_num_threads())


def cached_pages(path: Path) -> int:
    """How many of the file's memory pages the page cache holds: mincore(2) over a read-only
    mapping of it (mapping reads nothing)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec)


def drop_from_page_cache(path: Path) -> None:
    """Evict the file from the page cache, and check that it left: a drop right after other I/O
    sometimes leaves pages behind, and a "cold" restore that finds them would flatter itself."""
    for _ in range(10):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if not cached_pages(path):
            return
        time.sleep(0.001)
    raise RuntimeError(f"{path} stays in the page cache after 10 drops")


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


def _pages(k: str) -> str:
    return f"{k} page" if k == "1" else f"{k} pages"


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def build_session(engine: Engine, tokens: int, session_id: str = "bench") -> tuple[Session, list[dict[str, Any]]]:
    """A session of about `tokens` tokens of real text, read in user messages of ~1,500 tokens,
    and the messages a client would send for it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent."}]
    piece = SAMPLE_TEXT
    while True:
        messages.append({"role": "user", "content": piece})
        final = None
        for event in engine.chat(ChatRequest(session_id, list(messages), max_tokens=1)):
            final = event.final or final
        assert final is not None
        messages.append({"role": "assistant", "content": final.content})
        if engine.sessions[session_id].transcript.tokens >= tokens:
            return engine.sessions[session_id], messages


class Restorer:
    """Times the server's restore of k cold pages (and evicts them again, untimed)."""

    def __init__(self, engine: Engine, session: Session, store: Path) -> None:
        self.engine, self.session, self.store = engine, session, store
        self.cold = [p.index for p in session.pager.pages if p.state is PageState.COLD]

    def files(self, pages: list[int]) -> list[Path]:
        records = self.engine.contextd.get_pages("bench", [self.session.pager.pages[i].page_id for i in pages])
        return [self.store / r.locator for r in records]

    def timed(self, pages: list[int], cold: bool) -> float:
        if cold:
            for path in self.files(pages):
                drop_from_page_cache(path)
        backend = self.engine.backend
        backend.synchronize()
        started = time.perf_counter()
        restored = self.engine.mover.execute(self.session, Decision(evict=[], restore=pages, plan_used=False))
        backend.synchronize()
        seconds = time.perf_counter() - started
        assert restored == sorted(pages), f"restored {restored} of {pages}"
        self.engine.mover.execute(self.session, Decision(evict=sorted(pages), restore=[], plan_used=False))
        return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=12288, help="session length (most of it goes cold)")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15, help="restore / store / dd repetitions")
    parser.add_argument("--recompute-repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="folder for the store (default: system temp)")
    args = parser.parse_args(argv)

    machine0, own0 = machine_cpu_seconds(), process_cpu_seconds(os.getpid())
    work = Path(tempfile.mkdtemp(prefix="kve-restore-", dir=args.dir))
    daemon = ContextdProcess(work / "root", work / "c.sock", extra=["--reserve-bytes", "0"])
    daemon.start()
    try:
        t_load = time.perf_counter()
        backend = load_backend(args.backend, args.model, device=args.device, dtype=args.dtype,
                               capacity=args.budget + 256)
        load_s = time.perf_counter() - t_load
        engine = Engine(backend, ChatFormat(backend.tokenizer), Client(daemon.socket), EngineConfig(
            budget_tokens=args.budget, max_new_tokens=1))
        freeze_loaded_heap()   # as `kv-elision serve` does once it has loaded the model
        t_build = time.perf_counter()
        session, _ = build_session(engine, args.tokens)
        build_s = time.perf_counter() - t_build
        restorer = Restorer(engine, session, daemon.root / "store")
        if len(restorer.cold) < max(K_PAGES):
            parser.error(f"only {len(restorer.cold)} cold pages; raise --tokens")
        restorer.timed(restorer.cold[-max(K_PAGES):], cold=False)  # warm-up: the slot buffers grow once
        page = restorer.cold[len(restorer.cold) // 2]
        page_tokens = session.transcript.ids[session.pager.pages[page].token_start:session.pager.pages[page].token_end]

        scratch = backend.fork()   # the session's attention, for recompute: the session itself is untouched
        restore_cold: list[float] = []
        restore_warm: list[float] = []
        recompute: list[float] = []
        spread = {k: restorer.cold[::max(1, len(restorer.cold) // k)][:k] for k in K_PAGES}
        by_k: dict[int, list[float]] = {k: [] for k in K_PAGES}
        warm_by_k: dict[int, list[float]] = {k: [] for k in K_PAGES}
        for i in range(args.repeats):
            restore_cold.append(restorer.timed([page], cold=True))
            restore_warm.append(restorer.timed([page], cold=False))
            for k in K_PAGES:
                by_k[k].append(restorer.timed(spread[k], cold=True))
            if i < args.recompute_repeats:
                held = scratch.attention_tokens
                scratch.synchronize()
                started = time.perf_counter()
                scratch.prefill(page_tokens)
                scratch.synchronize()
                recompute.append(time.perf_counter() - started)
                rewind(scratch, held)
        # Apart from the rounds above, so that the headline's neighbours stay what they were: the
        # cold page right after a warm 32-page decision took 8.1 ms against 5.7-6.3 after a cold one.
        for _ in range(args.repeats):
            for k in K_PAGES:
                warm_by_k[k].append(restorer.timed(spread[k], cold=False))

        payloads = engine.mover.payloads
        block_path = restorer.files([page])[0]
        block_bytes = block_path.stat().st_size

        # dd on the page's own file, before the compressed copy below replaces it in the store.
        dd_path = block_path.parent / "dd.bin"
        dd_write: list[float] = []
        dd_read: list[float] = []
        dd_cached_read: list[float] = []
        for _ in range(args.repeats):
            w = dd_seconds([f"if={block_path}", f"of={dd_path}", f"bs={IO_CHUNK_BYTES // 1024}K", "conv=fsync"])
            dd_seconds([f"if={dd_path}", "iflag=nocache", "count=0"])
            r = dd_seconds([f"if={dd_path}", "of=/dev/null", f"bs={IO_CHUNK_BYTES // 1024}K"])
            c = dd_seconds([f"if={dd_path}", "of=/dev/null", "bs=1M"])   # now in the page cache
            if c is not None:
                dd_cached_read.append(c)
            if w is not None:
                dd_write.append(w)
            if r is not None:
                dd_read.append(r)
        # The same page stored compressed (its manifest record now names the compressed file):
        # the server's restore again, cold.
        record = engine.contextd.get_pages("bench", [session.pager.pages[page].page_id])[0]
        block = Block.read(block_path, record.checksum, record.byte_size, expect=backend.layer_view)
        packed = payloads.write("bench", record.page_id, block.pieces(compress=True))
        compressed_record = pb.Page()
        compressed_record.CopyFrom(record)
        compressed_record.locator, compressed_record.byte_size = packed.locator, packed.byte_size
        compressed_record.checksum = packed.checksum
        engine.contextd.upsert_pages("bench", [compressed_record])
        restore_compressed = [restorer.timed([page], cold=True) for _ in range(args.repeats)]
        write_s: list[float] = []
        written = next(p.index for p in reversed(session.pager.pages) if p.resident and p.tokens == 128)
        for _ in range(args.repeats):
            backend.synchronize()
            started = time.perf_counter()
            engine.mover.store(session, [written])
            write_s.append(time.perf_counter() - started)

        counters = session.counters
        backend_counters = backend.counters
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    other_cpu = other_cpu_share(machine0, machine_cpu_seconds(), process_cpu_seconds(os.getpid()) - own0)
    restore_ms = median_ms(restore_cold)
    recompute_ms = median_ms(recompute)

    def mbps(samples: list[float]) -> float | None:
        return None if not samples else round(block_bytes / statistics.median(samples) / 1e6, 1)

    result: dict[str, Any] = {
        "restore_ms": round(restore_ms, 3),
        "recompute_ms": round(recompute_ms, 3),
        "restore_over_recompute": round(restore_ms / recompute_ms, 5),
        "restore_warm_ms": round(median_ms(restore_warm), 3),
        "restore_k_ms": {str(k): round(median_ms(v), 2) for k, v in by_k.items()},
        "restore_warm_k_ms": {str(k): round(median_ms(v), 2) for k, v in warm_by_k.items()},
        "restore_warm_k_mbps": {str(k): round(k * block_bytes / median_ms(v) / 1e3, 1) for k, v in warm_by_k.items()},
        "restore_compressed_ms": round(median_ms(restore_compressed), 3),
        "restore_compressed_over_recompute": round(median_ms(restore_compressed) / recompute_ms, 5),
        "compression_ratio": round(block_bytes / packed.byte_size, 3),
        "bytes_per_token": round(block_bytes / 128),
        "bytes_per_token_compressed": round(packed.byte_size / 128),
        "restore_warm_mbps": round(block_bytes / median_ms(restore_warm) / 1e3, 1),
        "restore_32_mbps": round(32 * block_bytes / median_ms(by_k[32]) / 1e3, 1),
        "restore_32_over_dd_read": None if not dd_read else round(
            32 * block_bytes / median_ms(by_k[32]) / 1e3 / (block_bytes / statistics.median(dd_read) / 1e6), 3),
        "store_write_mbps": mbps(write_s),
        "dd_write_mbps": mbps(dd_write),
        "dd_read_mbps": mbps(dd_read),
        "dd_cached_read_mbps": mbps(dd_cached_read),
        "restore_warm_over_dd_cached_read": None if not dd_cached_read else round(
            statistics.median(dd_cached_read) * 1e3 / median_ms(restore_warm), 3),
        "block_bytes": block_bytes,
        "historical_forward_during_restore": backend_counters.historical_forward_during_restore,
        "accounting_exact": counters.model_forward_tokens == counters.new_prefill_tokens + counters.decoded_tokens,
        "backend": args.backend,
        "device": backend.device,
        "model": backend.model_name,
        "dtype": args.dtype,
        "session_tokens": session.transcript.tokens,
        "budget_tokens": args.budget,
        "cold_pages": len(restorer.cold),
        "attention_tokens": backend.attention_tokens,
        "repeats": args.repeats,
        "recompute_repeats": len(recompute),
        "build_tok_s": round(session.transcript.tokens / build_s, 1),
        "load_s": round(load_s, 1),
        "other_processes_cpu_share": None if other_cpu is None else round(other_cpu, 3),
        "reliable": reliable(other_cpu),
        "torch_threads": _torch_threads(args.backend),
    }
    rows: list[tuple[str, str]] = [
        ("restore 1 page, cold file (server path: manifest to re-anchored keys)", f"{restore_ms:.2f} ms"),
        ("restore 1 page, file in page cache", f"{result['restore_warm_ms']:.2f} ms"),
        *((f"restore {_pages(k)} in one decision, cold files", f"{ms:.2f} ms")
          for k, ms in result["restore_k_ms"].items()),
        *((f"restore {_pages(k)} in one decision, files in page cache", f"{ms:.2f} ms")
          for k, ms in result["restore_warm_k_ms"].items()),
        ("recompute 128 tokens with the session's attention held", f"{recompute_ms:.1f} ms"),
        ("restore / recompute", f"{100 * result['restore_over_recompute']:.2f} %"),
        ("restore 1 page stored compressed, cold file", f"{result['restore_compressed_ms']:.2f} ms"),
        ("compressed restore / recompute", f"{100 * result['restore_compressed_over_recompute']:.2f} %"),
        ("compression (shuffle-zstd) ratio", f"{result['compression_ratio']:.3f}x"),
        ("block file", f"{block_bytes / 1e6:.2f} MB"),
        ("store write (save+writev+checksum+fsync+rename)", f"{result['store_write_mbps']} MB/s"),
        ("dd write (bs=64K conv=fsync)", f"{result['dd_write_mbps']} MB/s"),
        ("dd read (bs=64K, after iflag=nocache)", f"{result['dd_read_mbps']} MB/s"),
        ("dd read (bs=1M, file in page cache)", f"{result['dd_cached_read_mbps']} MB/s"),
        ("restore of 32 cold pages, payload rate", f"{result['restore_32_mbps']} MB/s"),
        ("restore 1 page in page cache, payload rate", f"{result['restore_warm_mbps']} MB/s"),
        *((f"restore {_pages(k)} in page cache in one decision, payload rate", f"{mb_s} MB/s")
          for k, mb_s in result["restore_warm_k_mbps"].items()),
        ("historical forward tokens during restore", str(result["historical_forward_during_restore"])),
        ("CPU taken by other processes during the run", "n/a" if other_cpu is None else f"{100 * other_cpu:.0f} %"),
    ]
    print(f"{args.backend} / {backend.device} / {backend.model_name} {args.dtype}: a {session.transcript.tokens}-token "
          f"session, {len(restorer.cold)} cold pages, budget {args.budget}")
    if not result["reliable"]:
        print("  " + unreliable_warning(other_cpu))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>12}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
