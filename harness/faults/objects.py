"""The object-store tier's faults, against a real Ceph RGW (harness/rgw.py): a lost reply on every
conditional PUT contextd makes (the holder writes of contextd.handover: a claim of a new
session, a renewal at a turn and during one, a publish, an adoption by another server, a
release, a tombstone, a claim over a tombstone), and cache pressure while a server streams a
session's resident pages back (fill_resident through a store folder far smaller than one page).

A lost reply is the S3 proxy of harness.faults.network dropping the store's answer to a PUT the
store applied: the client sends it again and gets a 412 caused by its own success. Each case
plays the whole script of holder writes with the reply of one of them lost, and is compared with
the script played with none lost: every call's outcome, and at the end a claim from the other
server that must adopt the session as it was left. A case that differs, fails or waits is stuck.

Depends on contextd's client and object store, harness.rgw, harness.faults.network and
serving.launcher.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.faults.network import S3Proxy

__all__ = ["CachePressure", "LostReplies", "cache_pressure", "lost_replies"]

CALL_DEADLINE_S = 60.0   # one call of the script; a call past it is stuck
CACHE_BYTES = 4096       # the store folder's bound under pressure: less than one tiny-llama page


@dataclass
class LostReplies:
    """Each conditional PUT whose reply was lost, and the cases that did not end as the script
    with none lost did."""

    cases: int = 0
    stuck: int = 0
    steps: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "stuck": self.stuck, "steps": self.steps}


class _Script:
    """The holder writes of a session's life across two contextd daemons A and B (standing for two
    servers sharing the object store), each call with the outcome a comparison needs."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def steps(self, sid: str) -> list[tuple[str, Callable[[], str]]]:
        a, b = self.a, self.b

        def hold(client: Any, **how: Any) -> Callable[[], str]:
            def call() -> str:
                got = client.hold_session(sid, "m", 30, **how)
                return f"adopted={got.adopted} token={got.token}"
            return call

        def publish(client: Any, turn: int, keep: int) -> Callable[[], str]:
            def call() -> str:
                _publish(client, sid, turn, keep)
                return f"turn {turn}"
            return call

        def delete() -> str:
            a.delete_session(sid)
            return "deleted"

        def open_session(client: Any) -> Callable[[], str]:
            def call() -> str:
                client.open_session(sid, model_id="m")
                return "opened"
            return call

        return [("a opens the session", open_session(a)),
                ("a claims a new session", hold(a)),
                ("a publishes turn 1", publish(a, 1, 0)),
                ("a renews its lease at its next turn", hold(a)),
                ("a renews its lease during the turn", hold(a, renew=True)),
                ("a publishes turn 2", publish(a, 2, 1)),
                ("b adopts the session", hold(b)),
                ("b releases it after a failed turn", hold(b, release=True)),
                ("a adopts it back", hold(a)),
                ("a publishes turn 3", publish(a, 3, 2)),
                ("a deletes it (tombstone)", delete),
                ("b claims over the tombstone", hold(b)),
                ("b opens the session afresh", open_session(b)),
                ("b publishes a new turn 1", publish(b, 1, 0)),
                ("a adopts it (the check)", hold(a)),
                ("a reads the record (the check)", lambda: f"record turn {a.read_record(sid).record.turn}")]


def _publish(client: Any, sid: str, turn: int, keep: int) -> None:
    """A turn's write-through as a server does it: a payload, its page row, then the record."""
    from contextd.client import pb
    from contextd.wire import PageState

    blob = client.payloads().write(sid, f"p{turn}", os.urandom(4096))
    client.upsert_pages(sid, [pb.Page(page_id=f"p{turn}", index=turn, token_start=128 * turn,
                                      token_end=128 * (turn + 1), state=PageState.COLD.value, dtype="float32",
                                      layer_view="v", locator=blob.locator, byte_size=blob.byte_size,
                                      checksum=blob.checksum)])
    client.write_record(sid, pb.SessionRecord(turn=turn, fingerprint="f"), keep_segments=keep,
                        append=[pb.TranscriptSegment(text=f"turn {turn}", token_ids=[turn])])


def _play(script: _Script, sid: str, proxy: S3Proxy, lose_at: int | None) -> tuple[list[str], bool, str]:
    """The script on session `sid`, the reply to the holder PUT of step `lose_at` lost: each
    step's outcome, whether that reply was lost, and the first call that took past its deadline."""
    outcomes: list[str] = []
    lost = False
    slow = ""
    for n, (label, call) in enumerate(script.steps(sid)):
        fault = proxy.lose_reply("PUT", f"/sessions/{sid}/holder") if n == lose_at else None
        started = time.monotonic()
        try:
            outcomes.append(call())
        except Exception as exc:  # noqa: BLE001 - an outcome, compared with the script's without a loss
            outcomes.append(type(exc).__name__)
        if time.monotonic() - started > CALL_DEADLINE_S and not slow:
            slow = label
        if fault is not None:
            lost = fault.reached.is_set()
            proxy.disarm(fault)
    return outcomes, lost, slow


def lost_replies(work: Path, rgw: Any, bucket_url: str) -> LostReplies:
    """Every conditional PUT of the script with its reply lost, one case each, on two contextd
    daemons reaching `rgw` through a proxy."""
    from serving.launcher import ContextdProcess

    found = LostReplies()
    work.mkdir(parents=True, exist_ok=True)
    proxy = S3Proxy(rgw.port)
    daemons = [ContextdProcess(work / name, work / f"{name}.sock", log=work / f"{name}.log",
                               extra=["--reserve-bytes", "0", "--object-store", bucket_url,
                                      "--object-endpoint", proxy.endpoint])
               for name in ("lost-a", "lost-b")]
    try:
        clients = [daemon.start() for daemon in daemons]
        script = _Script(*clients)
        labels = [label for label, _ in script.steps("x")]
        expected, _, _ = _play(script, "ref", proxy, None)
        checks = sum(label.endswith("(the check)") for label in labels)
        for n, label in enumerate(labels[:-checks]):
            outcomes, lost, slow = _play(script, f"lost-{n}", proxy, n)
            if not lost:
                continue   # a step without a conditional PUT: no case
            found.cases += 1
            found.steps.append(label)
            differ = [f"{labels[k]}: {got!r}, not {want!r}" for k, (got, want) in
                      enumerate(zip(outcomes, expected, strict=True)) if got != want]
            if differ or slow:
                found.stuck += 1
                found.problems.append(f"the reply to '{label}' lost: " + "; ".join(
                    differ + ([f"'{slow}' took over {CALL_DEADLINE_S:g} s"] if slow else [])))
    finally:
        for daemon in daemons:
            daemon.stop()
        proxy.close()
    return found


@dataclass
class CachePressure:
    """Turns whose session came back through a store folder smaller than a page, and the pages
    reported corrupt meanwhile (a payload evicted from the folder is fetched again, never marked
    corrupt); the answers are checked against a server on local disk."""

    cases: int = 0
    false_corrupt: int = 0
    fetched: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "false_corrupt": self.false_corrupt, "objects_fetched": self.fetched}


def _notes(name: str) -> list[dict[str, Any]]:
    body = " ".join(f"{name}_{i}" for i in range(200))
    return [{"role": "system", "content": "You are a coding agent. Be brief."},
            {"role": "user", "content": f"Notes of {name}:\n{body}\nRemember them."}]


def cache_pressure(work: Path, rgw: Any, bucket_url: str, rounds: int) -> CachePressure:
    """Two sessions take turns on one resident cache for `rounds` rounds, so each turn after the
    first two streams its session's resident pages back (fill_resident) from an object store
    through a folder of CACHE_BYTES; the same turns on a server on local disk are the twin."""
    from contextd.wire import PageState
    from serving.launcher import ContextdProcess, ServerProcess

    found = CachePressure()
    extra = ["--tail-tokens", "256", "--max-new-tokens", "4"]
    tiered = ServerProcess(root=work / "pressure", model="tiny-llama", budget=1024, extra=extra)
    tiered.contextd = ContextdProcess(tiered.root / "contextd", tiered.socket, log=tiered.root / "contextd.log",
                                      extra=["--reserve-bytes", "0", "--object-store", bucket_url,
                                             "--object-endpoint", rgw.endpoint, "--cache-bytes", str(CACHE_BYTES)])
    local = ServerProcess(root=work / "pressure-twin", model="tiny-llama", budget=1024, extra=extra)
    try:
        tiered.start()
        local.start()
        transcripts = {(server, name): _notes(name) for server in ("tiered", "local") for name in ("a", "b")}
        for turn in range(rounds):
            for name in ("a", "b"):
                answers = []
                for label, server in (("tiered", tiered), ("local", local)):
                    messages = transcripts[label, name]
                    reply = server.chat(messages, session=name, max_tokens=4)
                    answer = reply.body["choices"][0]["message"]["content"] if reply.status == 200 else None
                    answers.append(answer)
                    messages += [{"role": "assistant", "content": answer or ""},
                                 {"role": "user", "content": f"Question {turn}: what was note {name}_{7 * turn}?"}]
                found.cases += int(turn > 0)
                if answers[0] is None or answers[0] != answers[1]:
                    found.problems.append(f"session {name} turn {turn}: {answers[0]!r}, on local disk {answers[1]!r}")
        assert tiered.contextd.client is not None
        client = tiered.contextd.client
        for name in ("a", "b"):
            corrupt = [p.page_id for p in client.query_pages(name) if PageState(p.state) is PageState.CORRUPT]
            found.false_corrupt += len(corrupt)
            if corrupt:
                found.problems.append(f"session {name}: pages reported corrupt: {corrupt[:4]}")
            notes = tiered.stats(name).get("recovery_notes") or []
            if any("corrupt" in str(note).lower() for note in notes):
                found.problems.append(f"session {name}: recovery says {notes[:2]}")
        found.fetched = int(client.status().objects_fetched)
        if found.fetched == 0:
            found.problems.append("no page came back from the object store: the folder was never under pressure")
    finally:
        tiered.stop()
        local.stop()
    return found


def new_bucket(rgw: Any) -> str:
    """A fresh bucket on `rgw` (its credentials in this process's environment); its s3:// URL."""
    from contextd.objects import ObjectStore, ObjectStoreConfig

    store = ObjectStore(ObjectStoreConfig(url=f"s3://f-{uuid.uuid4().hex[:12]}", endpoint=rgw.endpoint))
    store.ensure_bucket()
    return store.config.url
