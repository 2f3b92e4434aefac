"""The `contextd` command: serve | status | watch | gc | verify.

Every verb but `serve` talks to a running daemon through contextd.client; each takes --socket
(default: where `serve` puts it, see contextd.paths). Exit status: 0 on success, 1 when the
daemon reported a problem (e.g. corrupt pages), 2 on a usage error or an unreachable daemon.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from contextd.blobs import Reserve
from contextd.client import Client, pb
from contextd.clock import Clock
from contextd.daemon import DaemonConfig
from contextd.errors import ContextdError
from contextd.objects import ObjectStoreConfig
from contextd.paths import default_root, default_socket
from contextd.retention import Retention
from contextd.store import SyncMode


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _parse_size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    body = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = body[-1:] if body[-1:] in units else ""
    try:
        value = float(body[: len(body) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G, 1048576)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative: {text!r}")
    return int(value * units[unit])


def _parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body = text.strip().lower()
    unit = body[-1:] if body[-1:] in units else "s"
    try:
        value = float(body[: len(body) - 1] if body[-1:] in units else body)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 3600)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"duration must not be negative: {text!r}")
    return value * units[unit]


def status_line(reply: pb.StatusReply) -> str:
    """One line for a status bar: every session's pages and attention use. `hot` counts every page
    in attention; `pinned` is the part of them that carries a pin."""
    parts = []
    for s in reply.sessions:
        p = s.pages
        parts.append(f"{s.session_id}: hot {p.hot} cold {p.cold} pinned {p.pinned} | attn "
                     f"{s.attention_tokens}/{s.budget_tokens} | restored {s.counters.get('restored_pages_turn', 0)} "
                     f"this turn, {s.counters.get('restored_pages', 0)} in all")
    body = "; ".join(parts) if parts else "no sessions"
    return f"kv #{reply.commit_seq} {body}"


def _print_status(reply: pb.StatusReply) -> None:
    print(f"contextd pid {reply.pid}  root {reply.root}  sync {reply.sync_mode}  schema v{reply.schema_version}  "
          f"up {reply.uptime_s:.0f}s")
    print(f"commits {reply.commit_seq}  last commit {reply.last_commit_ms:.2f} ms  store {_size(reply.store_bytes)}  "
          f"free {_size(reply.free_bytes)}  reserve {_size(reply.reserve_bytes)}"
          + (f"  quota {_size(reply.quota_bytes)}" if reply.quota_bytes else "")
          + (f"  per-session quota {_size(reply.session_quota_bytes)}" if reply.session_quota_bytes else "")
          + (f"  max idle {reply.max_idle_s / 3600:.0f} h" if reply.max_idle_s else ""))
    if reply.object_store:
        limit = _size(reply.cache_limit_bytes) if reply.cache_limit_bytes else "unbounded"
        print(f"object store {reply.object_store}  cache {_size(reply.cached_bytes)} of {limit}  "
              f"uploaded {reply.objects_uploaded}  fetched {reply.objects_fetched}  node {reply.node}")
    if not reply.sessions:
        print("no sessions")
        return
    header = ("SESSION", "TURN", "ATTN/BUDGET", "HOT", "COLD", "PINNED", "DROPPED", "CORRUPT", "TOKENS h/c/p",
              "ON DISK", "SNAPSHOTS")
    rows = [header]
    for s in reply.sessions:
        p = s.pages
        rows.append((s.session_id + (" (closed)" if s.closed else ""), str(s.turn),
                     f"{s.attention_tokens}/{s.budget_tokens}", str(p.hot), str(p.cold), str(p.pinned),
                     str(p.dropped), str(p.corrupt), f"{p.hot_tokens}/{p.cold_tokens}/{p.pinned_tokens}",
                     _size(p.bytes_on_disk), str(s.snapshots)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _as_json(message: Message) -> str:
    return json.dumps(MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True), sort_keys=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from contextd.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    root = Path(args.root)
    reserve = Reserve(bytes=args.reserve_bytes, percent=args.reserve_percent, quota_bytes=args.quota_bytes)
    retention = Retention(session_quota_bytes=args.session_quota_bytes, max_idle_s=args.max_idle)
    objects = ObjectStoreConfig(url=args.object_store, endpoint=args.object_endpoint, deadline_s=args.object_deadline,
                                connect_timeout_s=min(3.0, args.object_deadline),
                                read_timeout_s=min(20.0, args.object_deadline)) if args.object_store else None
    config = DaemonConfig(root=root, sync=SyncMode.parse(args.sync), reserve=reserve, retention=retention,
                          objects=objects, cache_bytes=args.cache_bytes, object_gc_grace_s=args.object_gc_grace,
                          clock=Clock.from_environment())
    return serve(config, Path(args.socket) if args.socket else default_socket(root))


def cmd_status(args: argparse.Namespace) -> int:
    with Client(args.socket) as client:
        reply = client.status(args.session, include_closed=args.all)
    if args.json:
        print(_as_json(reply))
    else:
        _print_status(reply)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    with Client(args.socket) as client:
        for reply in client.watch_status(args.session):
            print(_as_json(reply) if args.json else status_line(reply), flush=True)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    with Client(args.socket) as client:
        reply = client.gc(dry_run=args.dry_run)
    print(_as_json(reply) if args.json else
          f"{'would remove' if args.dry_run else 'removed'} {reply.orphan_files_removed} orphan and "
          f"{reply.temp_files_removed} temporary files ({_size(reply.bytes_freed)}); "
          f"{reply.leases_expired} expired leases; {reply.idle_sessions_deleted} idle sessions"
          + (f"; {reply.orphan_objects_removed} orphan objects ({_size(reply.object_bytes_freed)})"
             if reply.orphan_objects_removed else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with Client(args.socket) as client:
        reply = client.verify(args.session)
    if args.json:
        print(_as_json(reply))
    else:
        print(f"checked {reply.pages_checked} pages and {reply.snapshots_checked} snapshots "
              f"({_size(reply.bytes_read)}): {reply.pages_ok} pages ok, {len(reply.corrupt)} corrupt")
        for ref in reply.corrupt:
            print(f"  corrupt: {ref.session_id}/{ref.page_id}")
    return 1 if reply.corrupt else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contextd", description="kv-elision's control-plane daemon and its tools")
    sub = parser.add_subparsers(dest="verb", required=True)

    def with_socket(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--socket", default=None,
                       help=f"daemon socket (default: {default_socket()})")
        return p

    serve = with_socket(sub.add_parser("serve", help="run the daemon"))
    serve.add_argument("--root", default=str(default_root()), help="folder for the database and the store")
    serve.add_argument("--sync", default="full", choices=[m.value for m in SyncMode],
                       help="durability of commits (full: nothing acknowledged is lost; see docs/contextd.md)")
    serve.add_argument("--reserve-bytes", type=_parse_size, default=1 << 30,
                       help="free space the store must leave on its filesystem (default 1G)")
    serve.add_argument("--reserve-percent", type=float, default=0.0,
                       help="free space to leave, as a percent of the filesystem (the larger reserve wins)")
    serve.add_argument("--quota-bytes", type=_parse_size, default=0, help="cap on the store's own size (0: none)")
    serve.add_argument("--session-quota-bytes", type=_parse_size, default=0,
                       help="cap on one session's payloads; its least recently used cold pages go first (0: none)")
    serve.add_argument("--max-idle", type=_parse_duration, default=0.0,
                       help="delete sessions idle longer than this, e.g. 30d, 12h (0: keep them)")
    serve.add_argument("--object-store", default="", metavar="s3://BUCKET[/PREFIX]",
                       help="keep every payload in this S3-compatible object store (the durable tier); the store "
                       "folder becomes a cache in front of it. Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                       "or any source boto3 reads (docs/deployment.md)")
    serve.add_argument("--object-endpoint", default="", metavar="URL",
                       help="the object store's address, e.g. http://127.0.0.1:7480 for a Ceph RGW (default: AWS)")
    serve.add_argument("--object-deadline", type=float, default=30.0, metavar="S",
                       help="how long one object-store request may keep retrying before the write or read fails "
                       "with 'object store unavailable' (default 30)")
    serve.add_argument("--cache-bytes", type=_parse_size, default=0,
                       help="with --object-store: the most the store folder keeps, least recently used out "
                       "(0: no bound)")
    serve.add_argument("--object-gc-grace", type=float, default=3600.0, metavar="S",
                       help="with --object-store: gc leaves objects younger than this, which may be uploads whose "
                       "commit has not landed yet (default 3600)")
    serve.set_defaults(run=cmd_serve)

    status = with_socket(sub.add_parser("status", help="sessions, pages, store and commit figures"))
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.add_argument("--session", default="", help="only this session")
    status.add_argument("--all", action="store_true", help="include closed sessions")
    status.set_defaults(run=cmd_status)

    watch = with_socket(sub.add_parser("watch", help="one status line per change, for a status bar"))
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    watch.add_argument("--session", default="", help="only this session")
    watch.set_defaults(run=cmd_watch)

    gc = with_socket(sub.add_parser("gc", help="remove orphan payload files, expired leases and sessions idle "
                                    "past --max-idle"))
    gc.add_argument("--dry-run", action="store_true", help="count, remove nothing")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(run=cmd_gc)

    verify = with_socket(sub.add_parser("verify", help="re-checksum every stored page"))
    verify.add_argument("--session", default="", help="only this session")
    verify.add_argument("--json", action="store_true")
    verify.set_defaults(run=cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except ContextdError as exc:
        print(f"contextd {args.verb}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
