"""What runs in a zygote's child: a real serving.worker.Worker around a real Engine, and a client
that re-sends a turn that failed, as Pi does; the "drive" job sends a scenario's requests under a
crash point, injected I/O faults or damaged payloads and reports every step.

Depends on serving (engine, HTTP worker and its status map), contextd's client and blob store,
controller.selectors and the campaign's scenarios.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

from contextd.wire import PageState
from harness.faults.scenarios import SCENARIOS, messages_for
from harness.faults.zygote import Reporter


def _manifest(client: Any, sid: str) -> list[list[Any]]:
    return sorted([p.page_id, int(p.state), p.checksum, int(p.byte_size)] for p in client.query_pages(sid))


def _inspect(client: Any, payloads: Any, sid: str) -> dict[str, Any]:
    """What a crash left in contextd, before anything recovers: the record's turn, the manifest,
    rows whose payload is missing, partial or failing its checksum, leftover temporary files."""
    from contextd.blobs import TEMP_PREFIX
    from contextd.errors import NotFound

    try:
        turn = int(client.read_record(sid).record.turn)
    except NotFound:
        turn = 0
    try:
        pages = list(client.query_pages(sid))
    except NotFound:
        pages = []
    half = [p.page_id for p in pages if p.locator and not payloads.blobs.exists(p.locator, p.byte_size)]
    half += [p.page_id for p in pages if not p.locator and PageState(p.state) is PageState.COLD]  # nothing behind it
    corrupt = [c.page_id for c in client.verify(sid).corrupt] if pages else []
    folder = payloads.blobs.root / sid
    temps = [f.name for f in folder.iterdir() if f.name.startswith(TEMP_PREFIX)] if folder.exists() else []
    return {"record_turn": turn, "manifest": sorted([p.page_id, int(p.state), p.checksum, int(p.byte_size)]
                                                    for p in pages),
            "half_present": half, "corrupt": corrupt, "temp_files": temps}


class Driver:
    """The client and the server, in one child: a real serving.worker.Worker around a real Engine
    (so every failure maps to the HTTP status a client would see), and a client that re-sends a
    turn that failed, as Pi does."""

    def __init__(self, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
        from contextd.client import Client
        from controller.selectors import AttentionSelector
        from serving.engine import Engine
        from serving.worker import Worker

        self.scenario = SCENARIOS[p["scenario"]]
        backend, chat_format = loaded[self.scenario.model]
        self.client = Client(p["socket"], timeout=60.0)
        self.engine = Engine(backend, chat_format, self.client, self.scenario.engine_config(),
                             AttentionSelector())
        self.payloads = self.engine.mover.payloads
        self.worker = Worker(self.engine)
        self.worker.start()
        self.sid = p["session"]
        self.inserted: list[str] = []        # page ids streamed into attention (restores, recoveries)
        self.served_corrupt: list[str] = []  # ... whose file did not hold the bytes first written
        self._watch_inserts()

    def _watch_inserts(self) -> None:
        """After every insert into attention, hash the file again: a payload that differs from its
        manifest checksum would be a corrupt page served (the insert checks it; this checks the check)."""
        import xxhash

        backend = self.engine.backend
        original = backend.insert_block_files

        def insert(files: Any, opened: Any = None) -> Any:
            results = original(files, opened)
            for stored, result in zip(files, results, strict=True):
                if result is not None:
                    continue
                page_id = Path(stored.path).name.split(".")[0]
                self.inserted.append(page_id)
                data = Path(stored.path).read_bytes() if Path(stored.path).exists() else b""
                if len(data) != stored.size or xxhash.xxh3_128_hexdigest(data) != stored.checksum:
                    self.served_corrupt.append(page_id)
            return results

        backend.insert_block_files = insert  # type: ignore[method-assign]

    def turn(self, messages: list[dict[str, Any]]) -> tuple[int, Any]:
        """One request through the worker: (200, TurnResult) or (status, message)."""
        from serving.http_request import RequestError
        from serving.turn import ChatRequest

        try:
            job = self.worker.submit(ChatRequest(self.sid, messages))
        except RequestError as refused:   # the worker has stopped
            return int(refused.status), f"{refused.kind}: {refused}"
        while True:
            event = self.worker.next_event(job, 1.0)
            if event is None:
                continue
            if isinstance(event, RequestError):
                return int(event.status), f"{event.kind}: {event}"
            if event.final is not None:
                return 200, event.final

    def checks(self) -> dict[str, Any]:
        """The invariants after a turn: accounting, budget, and attention holding exactly this
        session's resident pages (nothing of another session, nothing stale)."""
        import numpy as np

        with self.worker.lock:
            engine = self.engine
            session = engine.sessions.get(self.sid)
            if session is None or engine.active != self.sid:
                return {"ok": False, "why": "the session is not active after its turn"}
            c, t = session.counters, engine.totals
            pager = session.pager
            want = [tok for p in pager.pages if p.resident for tok in session.transcript.ids[p.token_start:p.token_end]]
            held = engine.backend.held_token_ids()
            why = []
            if c.model_forward_tokens != c.new_prefill_tokens + c.decoded_tokens + c.blend_forward_tokens:
                why.append("model_forward_tokens != new_prefill_tokens + decoded_tokens + blend_forward_tokens "
                           "(session)")
            if t.model_forward_tokens != t.new_prefill_tokens + t.decoded_tokens + t.blend_forward_tokens:
                why.append("model_forward_tokens != new_prefill_tokens + decoded_tokens + blend_forward_tokens "
                           "(server)")
            if c.historical_forward_during_restore or t.historical_forward_during_restore:
                why.append("historical_forward_during_restore != 0")
            if not np.array_equal(np.asarray(held), np.asarray(want, dtype=np.asarray(held).dtype)):
                why.append("attention holds other tokens than the session's resident pages")
            if engine.backend.attention_tokens > self.scenario.budget:
                why.append("attention over the budget")
            if pager.total_tokens != session.transcript.tokens:
                why.append("pager and transcript disagree on the session's length")
            return {"ok": not why, "why": "; ".join(why), "leak": "other tokens" in " ".join(why),
                    "counters": c.as_dict(), "pager": _pager(session)}

    def activate(self) -> dict[str, Any]:
        """Bring the session in (what the next request would do first) and describe it."""
        with self.worker.lock:
            engine = self.engine
            session = engine.activate(self.sid, engine.format.fingerprint(None, "default"))
            return {"turn": session.pager.turn, "tokens": session.transcript.tokens, "pager": _pager(session),
                    "notes": list(session.recovery_notes), "manifest": _manifest(self.client, self.sid)}


def _pager(session: Any) -> list[list[Any]]:
    """What the pager decides from, page by page: state, pin, lease, last use."""
    return [[p.index, p.state.name, p.pin.value if p.pin else "", p.lease_until_turn, p.last_used_turn]
            for p in session.pager.pages]


def job_drive(rep: Reporter, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
    """Send requests `sequence` of the scenario in order; report each one sent, acknowledged or
    failed. Options: `crash` [NAME, N] (this child SIGKILLs itself there), `inspect` (first look
    at what a crash left, then recover), `stays_up` (a failed request is re-sent, as the server
    keeps serving), `count` (count every crash point and file operation per request: the twin),
    `before` / `after` {request: [action, ...]}: actions run before the request is first sent and
    after it was answered (ok or not): ["inject", op, errno name, nth, times] (a fault at the
    file-I/O seam, cleared after the request), ["corrupt", page id | "@cold" | "@resident" |
    "@snapshot", how], ["forget"] (the server drops the session from memory: a restart without
    the crash), ["fill", folder, bytes left free], ["unfill", folder], ["remount", folder, "ro" | "rw"]."""
    from contextd import blobs, crashpoints
    from serving.http_request import error_for

    d = Driver(loaded, p)
    answers = {int(k): v for k, v in p.get("answers", {}).items()}
    hits: dict[str, int] = {}
    if p.get("count"):
        reached = crashpoints.reached

        def counting(name: str) -> None:
            hits[name] = hits.get(name, 0) + 1
            reached(name)

        crashpoints.reached = counting
        io = blobs._io

        def counting_io(op: str, path: object) -> None:
            hits["io." + op] = hits.get("io." + op, 0) + 1
            io(op, path)

        blobs._io = counting_io
    if p.get("crash"):
        name, n = p["crash"]
        crashpoints._TARGET = (name, int(n))
        crashpoints._hits = 0
    before: dict[str, list[list[Any]]] = dict(p.get("before", {}))
    after: dict[str, list[list[Any]]] = dict(p.get("after", {}))
    pending_inspect = bool(p.get("inspect"))
    todo = list(p["sequence"])
    failures = 0
    while todo or pending_inspect:
        if pending_inspect:
            try:
                rep.event(inspect=_inspect(d.client, d.payloads, d.sid))
                rep.event(recovered=d.activate())
                pending_inspect = False
            except Exception as exc:
                if not p.get("stays_up") or failures > 5:
                    raise
                failures += 1  # what the worker answers when bringing the session in fails like this
                rep.event(failed=todo[0] if todo else -1, status=int(error_for(exc).status),
                          error=f"{type(exc).__name__}: {exc}"[:400])
                d.engine.forget(d.sid)
                d.client.wait_ready(timeout=120)
            continue
        i = todo[0]
        armed = [_act(d, action) for action in before.pop(str(i), [])]
        fault = next((a for a in armed if isinstance(a, blobs.IOFault)), None)
        for info in armed:
            if isinstance(info, dict):
                rep.event(action=info)
        counted = dict(hits)
        commits = d.client.status().commit_seq if p.get("count") else 0
        rep.event(sent=i)
        status, result = d.turn(messages_for(d.scenario.users_at(i), answers, i))
        blobs.clear_fault()
        for action in after.pop(str(i), []):
            _act(d, action)
        fired = fault.fired if fault is not None else 0
        if status != 200:
            failures += 1
            rep.event(failed=i, status=status, error=str(result)[:400], fired=fired)
            if not p.get("stays_up") or failures > 5:
                raise RuntimeError(f"request {i} failed: {status} {result}")
            d.client.wait_ready(timeout=120)
            pending_inspect = True
            continue
        todo.pop(0)
        answers[i] = result.content
        event: dict[str, Any] = {"ack": i, "content": result.content, "checks": d.checks(), "fired": fired,
                                 "manifest": _manifest(d.client, d.sid), "rebuilt": result.rebuilt,
                                 "prefilled": result.prefilled_tokens,
                                 "inserted": list(d.inserted), "served_corrupt": list(d.served_corrupt)}
        d.inserted.clear()
        if p.get("count"):
            event["hits"] = {k: v - counted.get(k, 0) for k, v in hits.items() if v != counted.get(k, 0)}
            event["commits"] = d.client.status().commit_seq - commits
        rep.event(**event)
    rep.event(done=True, served_corrupt=d.served_corrupt)


def _act(d: Driver, action: list[Any]) -> Any:
    from contextd import blobs

    kind, *args = action
    if kind == "inject":
        op, name, nth, times = args
        return blobs.inject(op, getattr(errno, name), int(nth), int(times))
    if kind == "corrupt":
        return _corrupt(d, *args)
    if kind == "forget":
        with d.worker.lock:
            d.engine.forget(d.sid)
        return {"forgot": True}
    if kind == "fill":
        folder, leave = Path(args[0]), int(args[1])
        st = os.statvfs(folder)
        size = max(0, st.f_bavail * st.f_frsize - leave)
        with open(folder / "filler", "wb") as f:
            f.truncate(0)
            chunk = bytes(1 << 20)
            while size > 0:
                try:
                    size -= f.write(chunk[:min(size, len(chunk))])
                except OSError:
                    break
        return {"filled": str(folder), "free": os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize}
    if kind == "unfill":
        (Path(args[0]) / "filler").unlink(missing_ok=True)
        return {"unfilled": args[0]}
    if kind == "remount":
        subprocess.run(["mount", "-o", f"remount,{args[1]}", args[0]], check=True, capture_output=True)
        return {"remounted": args[1]}
    raise ValueError(f"unknown action {kind!r}")


def _corrupt(d: Driver, target: str, how: str) -> dict[str, Any]:
    """Damage one stored payload on disk the way a disk or a crash can: `flip` a byte, `torn`
    (the second half zeroed, as a write that never reached the platter), `truncate` to half,
    `empty`, `append` garbage, `missing`. The target: a page id, the session's first stored cold
    page ("@cold"), its first stored resident page ("@resident") or its recurrent snapshot."""
    client, sid = d.client, d.sid
    if target == "@snapshot":
        snaps = [s for s in client.query_snapshots(sid) if s.slot == "recurrent"]
        if not snaps:
            return {"skipped": "no snapshot"}
        locator, page_id = snaps[0].locator, "snapshot"
    else:
        pages = [p for p in client.query_pages(sid) if p.locator]
        if target.startswith("@"):
            want = 2 if target == "@cold" else 1  # COLD, HOT
            pages = [p for p in pages if int(p.state) == want and p.token_end - p.token_start == 128]
            if target == "@resident":
                pages = pages[1:] or pages  # not the pinned system page: a plain resident one
        else:
            pages = [p for p in pages if p.page_id == target]
        if not pages:
            return {"skipped": f"no page for {target}"}
        locator, page_id = pages[0].locator, pages[0].page_id
    path = d.payloads.path(locator)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    elif how == "torn":
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    elif how == "truncate":
        del data[len(data) // 2:]
    elif how == "empty":
        data = bytearray()
    elif how == "append":
        data += b"\0garbage"
    if how == "missing":
        path.unlink()
    else:
        os.chmod(path, 0o600)
        path.write_bytes(bytes(data))
    return {"page": page_id, "how": how}
