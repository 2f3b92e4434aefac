"""A soak under faults: kill -9 of the server and of contextd, clients that go away mid-answer, and
edits that cut history back, against a twin server that nothing disturbs.

    python -m benchmarks.chaos [--minutes 30] [--sessions 6] [--seed 1] [--model tiny-llama]

Two real `kv-elision serve` processes, each with its own contextd and data: the one under test
and its twin. A client plays `--sessions` agent sessions (a file read per turn, ~150-token files,
so pages leave and come back on a 768-token budget) in an order and with faults drawn from
`--seed`, until `--minutes` have passed. Each step is one of:
- a turn: the next file, as a user message;
- an edit: the last one to three exchanges are dropped and another message takes their place
  (what a client's rewind or edit sends; the server cuts its cache back);
- a client that goes away: the turn is streamed with room for a long answer and the connection is
  closed after the first chunk; the client then sends the turn again, as Pi retries;
- a kill: the turn is sent and, 0 to 400 ms later, the server or contextd is killed with SIGKILL
  and started again; the client re-sends until it is answered (503 while contextd is away; no
  answer at all while the server is), within a deadline.
Every turn the test server answers is then sent to the twin, and the answers compared; a turn the
test server committed without the client seeing it (killed after its record, or cut short by the
client) is first replayed on the twin (`mirrored`: the session's turn counter tells, its decoded
tokens say how long the cut answer was), so both served the same turns. An answer that
differs must say why: an `X-KV-Rebuilt` the twin did not give (the server started over from the
client's history), or `X-KV-Sampled` (the fixed-point guard, whose memory a restart clears). Any other difference is
silent (`silent_mismatches`), and must be 0. The twin's answer goes into the client's history; a
session whose answers parted with a reason is replaced by a new one (`retired`), since from there
its paging state and the twin's differ by design.
After the last step every session is asked once more (`final_*`). Restores compare each stored
page's prefix hash with the one the session's transcript gives (serving.page_records.foreign); the
server's log says how often that refused a payload (`foreign_refused`), and contextd's manifests
how many pages ended CORRUPT.

The last line is one JSON object with the counts above, `turns`, `kills_server`, `kills_contextd`,
`disconnects`, `edits`, `unexpected_statuses` (anything but 200 and 503 seen by the client, by
status) and `unanswered` (turns not answered within the deadline). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextd.wire import PageState
from harness.workload import evidence_files
from serving.launcher import Reply, ServerProcess

SYSTEM = {"role": "system", "content": "You are a coding agent. Read each file and keep notes."}
# How long a client keeps re-sending one turn (a restart of the server takes a few seconds).
ANSWER_DEADLINE_S = 180.0
RETRY_PAUSE_S = 0.25
# A session is retired for a new one past this many exchanges (its history is long enough to page).
MAX_EXCHANGES = 40
SERVER_FLAGS = ["--tail-tokens", "128", "--max-new-tokens", "256", "--client-timeout", "10"]
ANSWER_TOKENS = 6   # what a turn asks for; a client that goes away asks for the server's 256
STEPS = (("turn", 0.70), ("edit", 0.10), ("disconnect", 0.08), ("kill_server", 0.06), ("kill_contextd", 0.06))


@dataclass
class Figures:
    turns: int = 0
    compared: int = 0
    same: int = 0
    rebuilt: int = 0
    sampled: int = 0
    silent_mismatches: int = 0
    kills_server: int = 0
    kills_contextd: int = 0
    disconnects: int = 0
    edits: int = 0
    unanswered: int = 0
    final_sessions: int = 0
    final_same: int = 0
    final_said_why: int = 0
    mirrored: int = 0   # turns the test server committed without answering, replayed on the twin
    retired: int = 0    # sessions whose paging state legitimately left the twin's (said why), replaced
    unexpected_statuses: Counter[int] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


@dataclass
class Session:
    session_id: str
    files: list[str]
    messages: list[dict[str, Any]] = field(default_factory=lambda: [SYSTEM])
    read: int = 0
    turns: int = 0      # the test server's turns of this session, as its last answer counted them
    decoded: int = 0    # and its decoded tokens
    history: list[str] = field(default_factory=list)   # its steps, for the note on a silent mismatch
    parted: bool = False   # a silent mismatch was noted (its later turns are counted, not noted)

    def next_message(self, rng: random.Random, edited: bool = False) -> dict[str, Any]:
        text = self.files[self.read % len(self.files)]
        self.read += 1
        ask = "Forget that; read this instead." if edited else "Note what this file sets."
        return {"role": "user", "content": f"{ask}\n\n{text}\n\n(step {rng.randint(0, 9999)})"}


class Chaos:
    """The client, both servers and the figures."""

    def __init__(self, work: Path, model: str, budget: int, seed: int, sessions: int) -> None:
        self.rng = random.Random(seed)
        self.model = model
        self.test = ServerProcess(root=work / "test", model=model, budget=budget, extra=SERVER_FLAGS)
        self.twin = ServerProcess(root=work / "twin", model=model, budget=budget, extra=SERVER_FLAGS)
        self.figures = Figures()
        self.started = 0
        self.sessions = [self._new_session() for _ in range(sessions)]

    def _new_session(self) -> Session:
        self.started += 1
        files = [f.text for f in evidence_files(12, tokens_per_file=150, seed=self.rng.randint(0, 10**6))]
        return Session(f"chaos-{self.started:04d}", files)

    # ------------------------------------------------------------------ requests

    def _post(self, server: ServerProcess, messages: list[dict[str, Any]], session: str) -> Reply | None:
        """One request; None when the server did not answer (it is down, or died meanwhile)."""
        try:
            return server.chat(messages, session=session, max_tokens=ANSWER_TOKENS)
        except (OSError, http.client.HTTPException):
            return None

    def _ensure_up(self) -> None:
        """Start whatever of the test server's pair is down (a kill's aftermath)."""
        assert self.test.contextd is not None
        if not self.test.contextd.running:
            self.test.contextd.start()
        if self.test.proc is None or self.test.proc.poll() is not None:
            self.test.start()

    def answered(self, messages: list[dict[str, Any]], session: str, first: Reply | None = None) -> Reply | None:
        """The test server's answer to `messages`, re-sent until it answers 200 (a client that
        retries, as Pi does), within the deadline; None past it or on a status that is not 503."""
        deadline = time.monotonic() + ANSWER_DEADLINE_S
        reply = first
        while time.monotonic() < deadline:
            if reply is not None:
                if reply.status == 200:
                    return reply
                if reply.status != 503:
                    self.figures.unexpected_statuses[reply.status] += 1
                    self.figures.notes.append(f"{session}: {reply.status} {str(reply.body)[:200]}")
                    return None
            self._ensure_up()
            time.sleep(RETRY_PAUSE_S)
            reply = self._post(self.test, messages, session)
        self.figures.unanswered += 1
        self.figures.notes.append(f"{session}: not answered within {ANSWER_DEADLINE_S:.0f} s")
        return None

    def killed_during(self, messages: list[dict[str, Any]], session: str, contextd: bool) -> Reply | None:
        """Send the turn and kill the server (or its contextd) 0-400 ms later."""
        box: dict[str, Reply | None] = {}
        sender = threading.Thread(target=lambda: box.update(r=self._post(self.test, messages, session)))
        sender.start()
        time.sleep(self.rng.uniform(0.0, 0.4))
        if contextd:
            assert self.test.contextd is not None
            self.test.contextd.kill9()
            self.figures.kills_contextd += 1
        else:
            self.test.kill9()
            self.figures.kills_server += 1
        sender.join(ANSWER_DEADLINE_S)
        self._ensure_up()
        return self.answered(messages, session, box.get("r"))

    def went_away(self, messages: list[dict[str, Any]], session: str) -> Reply | None:
        """Stream the turn with room for a long answer, close after the first chunk, send it again."""
        self.figures.disconnects += 1
        try:
            streamed = self.test.stream(messages, session, max_tokens=256)
            if streamed.status == 200:
                chunks = streamed.chunks()
                next(chunks, None)
                chunks.close()   # closes the connection mid-answer
            else:
                streamed.conn.close()
        except (OSError, http.client.HTTPException):
            pass
        return self.answered(messages, session)

    # ------------------------------------------------------------------ the steps

    def _twin(self, session: Session, messages: list[dict[str, Any]], max_tokens: int = ANSWER_TOKENS) -> Reply:
        try:
            twin = self.twin.chat(messages, session=session.session_id, max_tokens=max_tokens)
        except (OSError, http.client.HTTPException) as exc:
            raise RuntimeError(f"the twin failed {session.session_id}: {exc}") from exc
        if twin.status != 200:
            raise RuntimeError(f"the twin failed {session.session_id}: {twin.status} {twin.body}")
        return twin

    def mirror(self, session: Session, messages: list[dict[str, Any]], reply: Reply, disconnected: bool) -> bool:
        """Replay on the twin a turn the test server committed without the client seeing its
        answer (killed after its record, or cut by the client), so both have served the same
        turns; False (and the session is retired) where it cannot be told what that turn was."""
        counters = reply.body["kv"]
        extra = counters["turns"] - session.turns - 1
        if extra == 0:
            return True
        if extra != 1:
            self.figures.notes.append(f"{session.session_id}: {extra} turns committed unseen; retired")
            return False
        tokens = ANSWER_TOKENS
        if disconnected:
            # The cut turn decoded k tokens; its retry decoded its answer, and, if the fixed-point
            # guard sampled it, first the k-token greedy repeat it then replaced.
            spent = counters["decoded_tokens"] - session.decoded - reply.body["usage"]["completion_tokens"]
            tokens = spent // 2 if "x-kv-sampled" in reply.headers else spent
        if tokens <= 0:
            self.figures.notes.append(f"{session.session_id}: a committed cut turn of {tokens} tokens; retired")
            return False
        self._twin(session, messages, max_tokens=tokens)
        self.figures.mirrored += 1
        session.history.append(f"mirrored {tokens} tokens")
        return True

    def compare(self, session: Session, messages: list[dict[str, Any]], reply: Reply, final: bool = False) -> bool:
        """Send the turn the test server answered to the twin; count the answers alike or not.
        False when they legitimately part (said why): the session is then retired."""
        twin = self._twin(session, messages)
        mine, theirs = reply.body["choices"][0]["message"], twin.body["choices"][0]["message"]
        f = self.figures
        f.compared += 1
        # The test server started over where the twin did not, or either one's fixed-point guard sampled.
        started_over = reply.headers.get("x-kv-rebuilt") != twin.headers.get("x-kv-rebuilt")
        sampled = "x-kv-sampled" in reply.headers or "x-kv-sampled" in twin.headers
        if mine == theirs:
            f.same += 1
            f.final_same += int(final)
        elif started_over or sampled:
            f.rebuilt += int(started_over)
            f.sampled += int(sampled)
            f.final_said_why += int(final)
        else:
            f.silent_mismatches += 1
            if not session.parted:
                f.notes.append(f"{session.session_id} at {len(messages)} messages: {json.dumps(mine)[:120]} "
                               f"against the twin's {json.dumps(theirs)[:120]}; its last steps: "
                               + ", ".join(session.history[-6:]))
            session.parted = True
        reply_message: dict[str, Any] = {"role": "assistant", "content": theirs.get("content") or ""}
        session.messages = [*messages, reply_message]
        session.turns, session.decoded = reply.body["kv"]["turns"], reply.body["kv"]["decoded_tokens"]
        return mine == theirs or not (started_over or sampled)

    def step(self) -> None:
        session = self.rng.choice(self.sessions)
        kind = self.rng.choices([k for k, _ in STEPS], weights=[w for _, w in STEPS])[0]
        messages = list(session.messages)
        exchanges = (len(messages) - 1) // 2
        if kind == "edit" and exchanges >= 2:
            drop = self.rng.randint(1, min(3, exchanges - 1))
            messages = messages[:len(messages) - 2 * drop]
            messages.append(session.next_message(self.rng, edited=True))
            self.figures.edits += 1
        else:
            messages.append(session.next_message(self.rng))
        session.history.append(f"{kind} at {len(messages)}")
        if kind == "disconnect":
            reply = self.went_away(messages, session.session_id)
        elif kind in ("kill_server", "kill_contextd"):
            reply = self.killed_during(messages, session.session_id, contextd=kind == "kill_contextd")
        else:
            reply = self.answered(messages, session.session_id, self._post(self.test, messages, session.session_id))
        self.figures.turns += 1
        if reply is None:
            return
        faulted = kind in ("disconnect", "kill_server", "kill_contextd")
        alike = (not faulted or self.mirror(session, messages, reply, disconnected=kind == "disconnect")) \
            and self.compare(session, messages, reply)
        if not alike or (len(session.messages) - 1) // 2 >= MAX_EXCHANGES:
            self.figures.retired += int(not alike)
            self.sessions[self.sessions.index(session)] = self._new_session()

    def final(self) -> None:
        """Every live session asked once more, with nothing disturbed."""
        for session in self.sessions:
            if len(session.messages) < 3:
                continue
            messages = [*session.messages, session.next_message(self.rng)]
            reply = self.answered(messages, session.session_id, self._post(self.test, messages, session.session_id))
            self.figures.final_sessions += 1
            if reply is not None:
                self.compare(session, messages, reply, final=True)

    def corrupt_pages(self) -> int:
        assert self.test.contextd is not None
        client = self.test.contextd.client
        return sum(1 for s in client.list_sessions() for p in client.query_pages(s.session_id)
                   if PageState(p.state) is PageState.CORRUPT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--budget", type=int, default=768)
    parser.add_argument("--work", default=None, help="folder for both servers' data (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or not 1 <= args.sessions <= 16:
        parser.error("give a positive --minutes and 1 to 16 --sessions")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kve-chaos-"))
    chaos = Chaos(work, args.model, args.budget, args.seed, args.sessions)
    try:
        chaos.test.start()
        chaos.twin.start()
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            chaos.step()
        chaos._ensure_up()
        chaos.final()
        corrupt = chaos.corrupt_pages()
        foreign = chaos.test.log.read_text(errors="replace").count("computed after another history")
    finally:
        chaos.test.stop()
        chaos.twin.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    f = chaos.figures
    for note in f.notes[:20]:
        print(note)
    result: dict[str, Any] = {
        "model": args.model, "budget": args.budget, "minutes": args.minutes, "seed": args.seed,
        "sessions_played": chaos.started, "turns": f.turns, "compared": f.compared, "same": f.same,
        "rebuilt": f.rebuilt, "sampled": f.sampled, "silent_mismatches": f.silent_mismatches,
        "kills_server": f.kills_server, "kills_contextd": f.kills_contextd, "disconnects": f.disconnects,
        "edits": f.edits, "unanswered": f.unanswered,
        "unexpected_statuses": {str(k): v for k, v in sorted(f.unexpected_statuses.items())},
        "mirrored": f.mirrored, "retired": f.retired,
        "final_sessions": f.final_sessions, "final_same": f.final_same, "final_said_why": f.final_said_why,
        "corrupt_pages": corrupt, "foreign_refused": foreign}
    print(f"{f.turns} turns in {args.minutes:g} min: {f.same}/{f.compared} answers as the twin's, "
          f"{f.rebuilt} rebuilt, {f.sampled} sampled, {f.silent_mismatches} silent; {f.kills_server} server and "
          f"{f.kills_contextd} contextd kills, {f.disconnects} disconnects, {f.edits} edits")
    print(json.dumps(result))
    ok = f.silent_mismatches == 0 and f.unanswered == 0 and not f.unexpected_statuses and corrupt == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
