"""The OpenAI-compatible HTTP server (`kv-elision serve`): one worker thread owns the model.

Routes:
  POST /v1/chat/completions   streaming (SSE) or not, `usage` included, tools passed to the template
  GET  /v1/models             the served model, with its attention budget
  GET  /v1/kv/stats[?session=ID]   one session's counters, page states and budget; else the totals
  GET  /v1/kv/pages?session=ID[&text=1]   every page: state, token range, the turn it last moved,
                              the score that brought it back; with text=1 (loopback clients only) its text
  POST /v1/kv/score             {"session": ID, "candidates": [...]}: score those answers (teacher-forced
                              log-probabilities) over the cache the session's next answer is read from;
                              with "branches": [selector names], that turn is first answered once per
                              selector in a branch of the session, from the same state (loopback only)
  GET  /v1/kv/score?session=ID  what the last watched turn read: the scores and its view, and each
                              branch's under "branches" (loopback only)
  GET  /health

Request threads parse and validate; the single worker runs turns in arrival order and streams
events back through a queue. It runs up to `--resident-sessions` turns of different sessions at
once, one step each in turn (a step is one prefill chunk, the plan, or one decoded token), so a
short request does not wait for another session's long prefill or answer; a session's own turns
run one after the other. The turns waiting for their next token after a round decode in one
batched forward (`Engine.decode_batch`; `--no-batch-decode` has each decode alone). Session
identity: the `X-KV-Session` header, else the
`X-Session-Affinity` header Pi sends, else a digest of the transcript's first messages. Response
headers say what the server did: `X-KV-Session`, `X-KV-Prefilled-Tokens`, and `X-KV-Rebuilt` /
`X-KV-Sampled` with a reason when it had to.

Bad requests get a 4xx with an OpenAI-style error body; nothing a client sends crashes the worker.
A connection holds a thread while it is open (at most MAX_CONNECTIONS of them) and must send each
request whole within the client timeout of its start. Stopping drains (`Server.shutdown`): no new
connection or turn, the turns running finish or are cut at a deadline, their answers are written.
Depends on serving.engine, serving.request_body, serving.transcript, controller.selectors and
contextd.errors.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import logging
import math
import queue
import re
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from backends import DecodeStep, blockfile
from contextd.errors import (
    ContextdError,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    SessionHeld,
    StoreFull,
    TierUnavailable,
)
from contextd.ids import MAX_ID_LENGTH, check_id
from controller.selectors import SELECTORS, make_selector
from serving import views
from serving.engine import Engine
from serving.request_body import BodyParser
from serving.transcript import TOOL_CALL_OPEN, TranscriptError, digest
from serving.turn import ChatRequest, Prepared, TurnEvent, TurnResult
from serving.watch import AnswerWatch

log = logging.getLogger("kv_elision.server")

MAX_BODY_BYTES = 32 << 20
# Each open connection holds a thread; past this many a new one is answered 503 and closed. An
# agent with subagents opens a few at once; the reliability campaign holds 40 stalled ones.
MAX_CONNECTIONS = 64
_DECIMAL = re.compile(r"[0-9]+")
# AnswerWatch.answer_in_branches (serving.watch) names each branch of a watched turn `ID-branch-<12 hex digits>`, a
# session id contextd must accept too.
BRANCH_SUFFIX_CHARS = len("-branch-") + 12
WORKER_STOP_S = 60.0  # past a drain's deadline: for the cut turns' last step and write-through
# A step of the worker (a prefill chunk, a turn's plan and restores, a token) running longer than
# this is stuck (a read hung in the kernel, a deadlock): /health says so and turns are refused.
STUCK_AFTER_S = 120.0
CLIENT_POLL_S = 0.25  # how often a turn's client's socket is looked at, and a waiting handler's worker
ADVERTISED_CONTEXT_WINDOW = 1_000_000  # the addressable session, not the attention budget


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass
class _Job:
    request: ChatRequest
    events: queue.Queue[TurnEvent | RequestError]
    gone: threading.Event  # the client disconnected: a queued turn is dropped, a running one ends
    client_gone: Callable[[], bool] = lambda: False   # what the client's socket says (the handler's)
    checked: float = -math.inf   # when the socket was last looked at

    def left(self) -> bool:
        """Whether the client is gone: its handler said so (a write failed or timed out), or its
        socket says so, looked at once per CLIENT_POLL_S. The request's `cancelled`: the engine
        asks it between decoded tokens, the worker between the steps before the answer."""
        now = time.monotonic()
        if not self.gone.is_set() and now - self.checked >= CLIENT_POLL_S:
            self.checked = now
            if self.client_gone():
                log.info("client left session %s; ending its turn", self.request.session_id)
                self.gone.set()
        return self.gone.is_set()


@dataclass
class _Turn:
    job: _Job
    steps: Generator[TurnEvent, int | None, None] = field(init=False)
    started: bool = False
    prepared: bool = False               # its prompt is in: from here it ends at a decoded token
    answered: bool = False               # its final event is out: it only reads ahead now
    decode: DecodeStep | None = None     # the decode step it waits on, run with the round's others
    token: int | None = None             # what that step picked, sent in at its next step
    failure: Exception | None = None     # or how the batched forward failed, thrown in instead


class Worker(threading.Thread):
    """The one thread that touches the engine (and so the model). It interleaves the turns of up
    to `resident_sessions` different sessions, a step at a time: each has a cache of its own, so
    going from one to the next moves no page (Engine.resume).

    It says when it cannot be trusted to answer (`stuck`): a step has run past `stuck_after_s`,
    or a read of the store is stuck in the kernel past its deadline (backends.blockfile). Then
    /health answers 503, no turn starts, and a client waiting for a stuck step is answered 503:
    the server fails closed instead of leaving everyone waiting, and a supervisor can restart it."""

    def __init__(self, engine: Engine, stuck_after_s: float = STUCK_AFTER_S) -> None:
        super().__init__(name="kv-elision-worker", daemon=True)
        self.engine = engine
        self.stuck_after_s = stuck_after_s
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.lock = threading.Lock()  # held during a step; stats readers take it briefly between steps
        self.busy_since: float | None = None   # (monotonic) when the step running now began
        self.failure: BaseException | None = None  # why the loop ended early, when it did
        self.waiting: deque[_Job] = deque()   # taken from `jobs`, not started yet (their session is busy)
        self.draining = False         # stopping: no turn starts; those running end by `cut_at`
        self.cut_at = math.inf        # (monotonic) when the turns still running are cut

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """A step: the lock, and its start for the watchdog (`stuck`)."""
        with self.lock:
            self.busy_since = time.monotonic()
            try:
                yield
            finally:
                self.busy_since = None

    def step_stuck(self) -> str | None:
        """Why the step running now counts as stuck (it has run past `stuck_after_s`), or None."""
        began = self.busy_since
        if began is None or time.monotonic() - began <= self.stuck_after_s:
            return None
        return f"the worker's step has run for {time.monotonic() - began:.0f} s (over {self.stuck_after_s:g} s)"

    def stuck(self) -> str | None:
        """Why no turn may start now, or None: a stuck step, or a read stuck past its deadline,
        which may still write into a cache's free slots until it returns (blockfile.stuck_reads)."""
        reads = blockfile.stuck_reads()
        if reads:
            return (f"a read of the store has been stuck for {reads[0].stalled_s:.0f} s ({reads[0].path}; "
                    f"{len(reads)} in all)")
        return self.step_stuck()

    def refused(self, reason: str) -> RequestError:
        """The answer while the worker is stuck (`stuck`)."""
        return RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"the server is stuck: {reason}; try again later",
                            "worker_stuck")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lock, for a reader of the engine's state between steps; 503 once the step holding
        it is stuck, instead of waiting for it."""
        while not self.lock.acquire(timeout=CLIENT_POLL_S):
            reason = self.step_stuck()
            if reason is not None:
                raise self.refused(reason)
        try:
            yield
        finally:
            self.lock.release()

    def submit(self, request: ChatRequest, client_gone: Callable[[], bool] | None = None) -> _Job:
        """Queue a turn; `client_gone` says whether its client has closed its end."""
        if self.failure is not None or self.draining:
            raise self.stopped()
        reason = self.stuck()
        if reason is not None:
            raise self.refused(reason)
        job = _Job(request, queue.Queue(), threading.Event())
        if client_gone is not None:
            job.client_gone = client_gone
        request.cancelled = job.left
        self.jobs.put(job)
        return job

    def next_event(self, job: _Job, wait_s: float) -> TurnEvent | RequestError | None:
        """The job's next event within `wait_s` seconds, else None; once the worker is gone and
        nothing is left for the job (it was submitted as the worker stopped), the answer no
        worker will send; once a step is stuck, 503 (the job is then let go: ended at its next
        step, should the worker come back)."""
        try:
            return job.events.get(timeout=wait_s)
        except queue.Empty:
            if not self.is_alive() and job.events.empty():
                return self.stopped()
            reason = self.step_stuck()
            if reason is not None:
                job.gone.set()
                return self.refused(reason)
            return None

    def stopped(self) -> RequestError:
        """The answer to a turn that no worker will run: the server is stopping, or its loop failed."""
        if self.failure is None:
            return RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is stopping")
        return RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"the server's worker stopped ({type(self.failure).__name__}: {self.failure}); "
                            "restart the server", "worker_stopped")

    @property
    def queued(self) -> int:
        """Turns not started yet."""
        return self.jobs.qsize() + len(self.waiting)

    def drain(self, deadline: float) -> None:
        """Stop: turns not started are answered 503 and none starts any more; those running may
        finish until `deadline` (monotonic), then each is cut (`_cut`); the worker then ends."""
        self.cut_at = deadline
        self.jobs.put(None)

    def run(self) -> None:
        """Serve turns until told to stop (`drain`). A failure of the loop itself (not of one
        turn: `_step` answers those) ends the worker, but never silently: every turn queued or
        running is answered, later ones are refused (`submit`, `next_event`) and /health says so,
        so neither a client nor a supervisor waits on a thread that is gone."""
        running: list[_Turn] = []
        try:
            self._serve(self.waiting, running)
        except BaseException as exc:  # noqa: BLE001 - recorded and answered to every waiting client
            self.failure = exc
            log.critical("the worker stopped; turns are refused until the server restarts", exc_info=True)
            self._answer_all(self.waiting, running)

    def _answer_all(self, waiting: deque[_Job], running: list[_Turn]) -> None:
        """Tell every turn running, waiting or still queued that no worker will run it (`stopped`)."""
        stopped = self.stopped()
        for job in [*(turn.job for turn in running), *waiting, *self._take(block=False)]:
            if job is not None:
                job.events.put(stopped)

    def _serve(self, waiting: deque[_Job], running: list[_Turn]) -> None:
        while True:
            arrived = self._take(block=not running and not waiting and not self.draining)
            waiting.extend(job for job in arrived if job is not None)
            if None in arrived:   # the server is stopping
                self.draining = True
                log.info("stopping: %d turns running may finish for %.1f s, %d not started are refused",
                         len(running), max(0.0, self.cut_at - time.monotonic()), len(waiting))
            if self.draining:
                stopped = self.stopped()
                while waiting:
                    waiting.popleft().events.put(stopped)
                self._cut(running, time.monotonic() >= self.cut_at)
                if not running:
                    return
            self._admit(waiting, running)
            for turn in list(running):
                if not self._step(turn):
                    running.remove(turn)
            self._decode(running)

    def _cut(self, running: list[_Turn], deadline: bool) -> None:
        """While draining: close the turns that answered and only read ahead; at the drain's
        `deadline`, end the others too, each as cleanly as where it is allows: one decoding ends at
        its next token as a cancelled turn (the cache holds what was picked, written through, its
        lease ended by its record), one still before its answer is closed (its lease released,
        nothing recorded: the client sends it again)."""
        for turn in list(running):
            if not turn.answered and not deadline:
                continue
            if not turn.answered and turn.prepared:
                turn.job.gone.set()
                continue
            running.remove(turn)
            session_id = turn.job.request.session_id
            with self._working():
                try:
                    turn.steps.close()
                except Exception:  # noqa: BLE001 - every other turn is still cut
                    log.exception("session %s: ending its turn at shutdown failed", session_id)
            if not turn.answered:
                log.info("session %s: its turn was cut before its answer as the server stopped", session_id)
                turn.job.events.put(self.stopped())

    def _take(self, block: bool) -> list[_Job | None]:
        """Every job queued now, the first one waited for when `block` (None: the server stops)."""
        taken: list[_Job | None] = []
        while True:
            try:
                taken.append(self.jobs.get(block=block and not taken))
            except queue.Empty:
                return taken

    def _admit(self, waiting: deque[_Job], running: list[_Turn]) -> None:
        """Start the waiting turns, in arrival order, of sessions with no turn running, while
        fewer than `resident_sessions` run; drop those whose client left. While the worker is
        stuck (a read that may still land in a cache's free slots) none starts: each is answered 503."""
        reason = self.stuck()
        if reason is not None:
            while waiting:
                waiting.popleft().events.put(self.refused(reason))
            return
        busy = {turn.job.request.session_id for turn in running}
        for job in list(waiting):
            if job.left():
                waiting.remove(job)
                log.info("session %s: the client left before its turn started; dropped", job.request.session_id)
                job.events.put(RequestError(HTTPStatus.BAD_REQUEST, "the client disconnected"))
            elif job.request.session_id not in busy and len(running) < self.engine.config.resident_sessions:
                waiting.remove(job)
                turn = _Turn(job)
                turn.steps = self.engine.chat(job.request)
                running.append(turn)
                busy.add(job.request.session_id)

    def _step(self, turn: _Turn) -> bool:
        """Advance one turn by a step: to its next pause, sending the client the events before it;
        False once it has ended. After its final event a turn only reads ahead for the controller
        model, a page a step (what else it leaves behind is there before its first pause). A pause
        with a decode step leaves the turn waiting for `_decode` when batching is on. Pauses are
        never sent to the client."""
        job = turn.job
        if turn.decode is not None:
            return True
        if not turn.prepared and job.left():
            self._drop(turn)
            return False
        with self._working():
            try:
                if turn.started:
                    self.engine.resume(job.request.session_id)
                turn.started = True
                token, failure, turn.token, turn.failure = turn.token, turn.failure, None, None
                event = turn.steps.throw(failure) if failure is not None else turn.steps.send(token)
                while not event.pause:
                    turn.prepared = turn.prepared or event.prepared is not None
                    turn.answered = turn.answered or event.final is not None
                    job.events.put(event)
                    event = next(turn.steps)
                if self.engine.config.batch_decode:
                    turn.decode = event.decode
                return True
            except StopIteration:
                return False
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any one turn
                error = error_for(exc)
                if error.kind == "server_error":
                    log.exception("turn failed")
                job.events.put(error)
                if not isinstance(exc, TranscriptError):
                    self._forget(job.request.session_id)
                return False

    def _drop(self, turn: _Turn) -> None:
        """End a turn whose client left before its prompt was in: between two prefill chunks (or
        before the first), not after the whole prompt and a token for nobody. The turn is closed
        as a failed one is (its lease released, the session dropped from memory), so the
        session's next turn starts from what contextd holds; the server's totals count it as a
        cancelled turn."""
        session_id = turn.job.request.session_id
        with self._working():
            try:
                turn.steps.close()
            except Exception:  # noqa: BLE001 - the session is forgotten below either way
                log.exception("session %s: closing the turn its client left failed", session_id)
            if turn.started:
                self._forget(session_id)
                self.engine.totals.add(cancelled_turns=1)
        log.info("session %s: the client left before its prompt was in; the turn ended", session_id)
        turn.job.events.put(RequestError(HTTPStatus.BAD_REQUEST, "the client disconnected"))

    def _forget(self, session_id: str) -> None:
        """Drop a failed turn's session from memory, so that its next turn starts from the last
        durable state. Emptying its cache can fail too (the backend that failed the turn): the
        worker then logs it and serves on, since the session is dropped before its cache is."""
        try:
            self.engine.forget(session_id)
        except Exception:  # noqa: BLE001 - the worker must outlive any one turn
            log.exception("session %s: emptying its cache after the failed turn failed too", session_id)

    def _decode(self, running: list[_Turn]) -> None:
        """The round's waiting decode steps, in one forward: each turn takes its token, or the
        forward's failure, at its next step."""
        waiting = [turn for turn in running if turn.decode is not None]
        if not waiting:
            return
        steps = {turn.job.request.session_id: turn.decode for turn in waiting if turn.decode is not None}
        with self._working():
            try:
                tokens = self.engine.decode_batch(steps)
            except Exception as exc:  # noqa: BLE001 - each turn fails as its own decode would have
                for turn in waiting:
                    turn.failure = exc
            else:
                for turn, token in zip(waiting, tokens, strict=True):
                    turn.token = token
        for turn in waiting:
            turn.decode = None


# What a failed turn answers, by the exception out of the engine: the first row whose type matches
# wins (DaemonUnavailable, TierUnavailable, StoreFull and DeadlineExceeded are ContextdErrors; OSError is
# EIO, EROFS, ... from the store's disk). A call that outlived its deadline committed nothing (a slow
# object store, a busy daemon): the client may send it again, so 503, not a 500 that reads as a bug.
# Anything else is a 500 "server_error". The reliability campaign's oracle reads it.
ERROR_STATUS: tuple[tuple[type[Exception], HTTPStatus, str], ...] = (
    (TranscriptError, HTTPStatus.BAD_REQUEST, "invalid_request_error"),
    (StoreFull, HTTPStatus.INSUFFICIENT_STORAGE, "store_full"),
    (DaemonUnavailable, HTTPStatus.SERVICE_UNAVAILABLE, "contextd_down"),
    (TierUnavailable, HTTPStatus.SERVICE_UNAVAILABLE, "object_store_unavailable"),
    (SessionHeld, HTTPStatus.CONFLICT, "session_held_elsewhere"),
    (DeadlineExceeded, HTTPStatus.SERVICE_UNAVAILABLE, "contextd_deadline_exceeded"),
    (ContextdError, HTTPStatus.INTERNAL_SERVER_ERROR, "contextd_error"),
    (OSError, HTTPStatus.SERVICE_UNAVAILABLE, "storage_unavailable"),
)


def error_for(exc: BaseException) -> RequestError:
    """The answer to a turn that raised `exc`, from ERROR_STATUS."""
    for kind, status, name in ERROR_STATUS:
        if isinstance(exc, kind):
            message = str(exc)
            if kind is OSError:
                message = f"the store's disk failed: {exc}"
            elif kind is DeadlineExceeded:
                message = f"contextd did not finish in time and committed nothing ({exc}); retry: send it again"
            return RequestError(status, message, name)
    return RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}", "server_error")


CONTEXT_MAX_PIECES = 80  # X-KV-Context, X-KV-Context-2, ...: one header line is capped at 64 KiB


def _context_header(headers: Any) -> str:
    """X-KV-Context and its continuation headers (-2, -3, ...), joined in order."""
    pieces = [headers.get("X-KV-Context") or ""]
    for n in range(2, CONTEXT_MAX_PIECES + 1):
        piece = headers.get(f"X-KV-Context-{n}")
        if piece is None:
            break
        pieces.append(piece)
    if headers.get(f"X-KV-Context-{CONTEXT_MAX_PIECES + 1}") is not None:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"X-KV-Context has more than {CONTEXT_MAX_PIECES} pieces")
    return "".join(pieces)


def _thinking(body: dict[str, Any], context: dict[str, Any] | None) -> str:
    if context is not None and isinstance(context.get("thinking"), str):
        return str(context["thinking"])
    effort = body.get("reasoning_effort")
    if isinstance(effort, str):
        return effort
    thinking = body.get("thinking") or body.get("enable_thinking")
    if isinstance(thinking, bool):
        return "on" if thinking else "off"
    if isinstance(thinking, dict):
        return str(thinking.get("type", "default"))
    return "default"


def checked_session(value: str, where: str) -> str:
    """`value` as a session id, exactly as the client sent it, or a 400 saying what an id may
    hold: contextd's rule (contextd.ids), checked here so that nothing a client names fails in
    contextd as a 500. Never rewritten, so two clients' ids never become one session."""
    try:
        return check_id(value, "session id")
    except InvalidArgument:
        raise RequestError(HTTPStatus.BAD_REQUEST,
                           f"{where}: session id {value[:40]!r}{'...' if len(value) > 40 else ''} ({len(value)} "
                           f"characters) is refused: use 1-{MAX_ID_LENGTH} characters from [A-Za-z0-9._:-], not "
                           "starting with '.'") from None


def session_header(headers: Any) -> str | None:
    """The session a request names, checked (`checked_session`); Pi sends its own id (provider
    compat `sendSessionAffinityHeaders`)."""
    for name in ("X-KV-Session", "X-Session-Affinity"):
        value = headers.get(name)
        if value:
            return checked_session(value, name)
    return None


def parse_chat(body: Any, headers: Any, model_id: str) -> tuple[ChatRequest, bool, bool]:
    """Validate a chat body; return the engine request, whether to stream, whether to add usage."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    model = body.get("model", model_id)
    if model != model_id:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {model!r} is not served here; this server serves {model_id!r}",
                           "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list of objects")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError(HTTPStatus.BAD_REQUEST, "tools must be a list of objects")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(HTTPStatus.BAD_REQUEST, "max_tokens must be a positive integer")
    temperature = body.get("temperature", 0.0)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0.0 <= temperature <= 2.0:
        raise RequestError(HTTPStatus.BAD_REQUEST, "temperature must be a number in [0, 2]")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise RequestError(HTTPStatus.BAD_REQUEST, "seed must be an integer")
    context = None
    raw_context = _context_header(headers)
    if raw_context:
        try:
            context = json.loads(raw_context)
        except json.JSONDecodeError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "X-KV-Context is not JSON") from None
        if not isinstance(context, dict) or not isinstance(context.get("messages", []), list):
            raise RequestError(HTTPStatus.BAD_REQUEST, "X-KV-Context must be an object with a messages list")
    session_id = session_header(headers)
    if session_id is None:
        opening = [m for m in messages if m.get("role") in ("system", "developer")][:1] + \
                  [m for m in messages if m.get("role") == "user"][:1]
        session_id = "auto-" + digest(opening)
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    include_usage = not stream or bool(isinstance(options, dict) and options.get("include_usage"))
    hashes = [str(h) for h in context["messages"]] if context and "messages" in context else None
    request = ChatRequest(session_id=session_id, messages=messages, tools=tools or None,
                          thinking=_thinking(body, context), max_tokens=max_tokens, temperature=float(temperature),
                          seed=seed, message_hashes=hashes)
    return request, stream, include_usage


def _usage(result: TurnResult) -> dict[str, Any]:
    cached = result.prompt_tokens - result.prefilled_tokens
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, cached)}}


class _ContentFilter:
    """Streams content but holds back anything that may be the start of a tool call, since tool
    calls go out as structured `tool_calls`, not text."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        cut = self.text.find(TOOL_CALL_OPEN)
        safe = len(self.text) if cut < 0 else cut
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text)), 0, -1):
            if cut < 0 and TOOL_CALL_OPEN.startswith(self.text[-k:]):
                safe = len(self.text) - k
                break
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self, content: str) -> str:
        """What is left to send once the final content (tool calls removed) is known."""
        return content[self.sent:] if content.startswith(self.text[:self.sent]) else ""


class _Answering:
    """The chat requests whose answer is not written yet: a stopping server waits for them, so a
    turn cut at shutdown still reaches its client."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def wait_done(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout)


class _RequestReader(io.RawIOBase):
    """A connection's reading side with a deadline: a request (its line, headers and body) must
    arrive within `wait_s` seconds of its start, however slowly its bytes trickle in. A timeout
    per read alone let a client that sends a byte now and then hold its thread for ever."""

    def __init__(self, sock: socket.socket, wait_s: float) -> None:
        super().__init__()
        self.sock = sock
        self.wait_s = wait_s
        self.deadline = math.inf   # set as each request starts (`Handler.handle_one_request`)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = min(self.wait_s, self.deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.wait_s:g} s")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.wait_s)   # what a write to this client may wait


def make_handler(worker: Worker, model_id: str, budget_tokens: int, max_new_tokens: int,
                 contextd_socket: str, api_key: str | None, client_timeout: float,
                 restore_pages: int, answering: _Answering) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {api_key}".encode() if api_key else None
    # The last body of each session the engine keeps in memory, forgotten with it.
    bodies = BodyParser(worker.engine.config.sessions_in_memory)
    worker.engine.sessions.on_drop(bodies.forget)
    answers = AnswerWatch(worker.engine)   # what /v1/kv/score watches and reads

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kv-elision"
        timeout = client_timeout  # seconds a client may stall sending its request or taking the answer
        reader: _RequestReader
        body_read = False   # this request's body was read: the connection may carry the next one

        def setup(self) -> None:
            super().setup()
            self.rfile.close()
            self.reader = _RequestReader(self.connection, client_timeout)
            self.rfile = io.BufferedReader(self.reader)
            self.watching = threading.Lock()   # the socket is looked at (`_client_gone`) or let go (`finish`)
            self.done = False

        def finish(self) -> None:
            """Before the connection closes (after this): a turn still running sees its client gone
            from now on, never a socket closed under it (or another connection on its number)."""
            with self.watching:
                self.done = True
            super().finish()

        def handle_one_request(self) -> None:
            self.reader.deadline = time.monotonic() + client_timeout
            self.body_read = False
            super().handle_one_request()

        def parse_request(self) -> bool:
            """http.server closes a blank request line without a word; a line of other whitespace
            (e.g. a lone 0xA0 byte, which str.split() takes as a space) gets a clear 400 instead.
            Headers that do not arrive by the request's deadline get a 408."""
            line = bytes(getattr(self, "raw_requestline", b"")).rstrip(b"\r\n")  # set by handle_one_request
            if line.strip() and not str(line, "iso-8859-1").split():
                self.command, self.request_version, self.close_connection = "", "HTTP/1.0", True
                self.requestline = repr(line)[2:-1]
                self.send_error(HTTPStatus.BAD_REQUEST, "the request line holds no method, path or version")
                return False
            try:
                return super().parse_request()
            except TimeoutError:
                self.close_connection = True
                self.send_error(HTTPStatus.REQUEST_TIMEOUT, f"the headers did not arrive within {client_timeout:g} s")
                return False

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _json(self, status: HTTPStatus, payload: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except OSError:   # gone, or stalled past the client timeout
                log.info("client left before its %d answer was written", status)
                self.close_connection = True

        def _error(self, error: RequestError) -> None:
            self._json(error.status, {"error": {"message": str(error), "type": error.kind, "code": error.status.value}})

        def _authorized(self) -> bool:
            """Whether the request carries `Authorization: Bearer KEY` (any request, for a server
            without a key: an in-process one; `kv-elision serve` always has one)."""
            if expected is None:
                return True
            given = (self.headers.get("Authorization") or "").encode("utf-8", "replace")
            return hmac.compare_digest(given, expected)

        def _authorize(self) -> None:
            """Every route but /health wants the key: loopback is every local user, and the
            routes serve the sessions (the user's code)."""
            if not self._authorized():
                raise RequestError(HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send Authorization: Bearer KEY",
                                   "invalid_api_key")

        def _health(self) -> None:
            """Liveness for anyone (a supervisor needs no key): the status alone; with the key,
            also the model, contextd's socket, the queued turns and why a stopped worker stopped
            or a stuck one is stuck. It never waits for the worker: a stuck one is a 503."""
            full = self._authorized()
            if worker.failure is not None:
                error = worker.stopped()
                self._json(error.status, {"status": "worker_stopped",
                                          **({"model": model_id, "error": str(error)} if full else {})})
                return
            reason = worker.stuck()
            if reason is not None:
                error = worker.refused(reason)
                self._json(error.status, {"status": "worker_stuck",
                                          **({"model": model_id, "error": str(error)} if full else {})})
                return
            self._json(HTTPStatus.OK, {"status": "ok", **({"model": model_id, "contextd_socket": contextd_socket,
                                                           "queued_turns": worker.queued} if full else {})})

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urlparse(self.path)
            try:
                self.close_connection = self.close_connection or self._content_length() > 0  # a body left unread
                if url.path == "/health":
                    self._health()
                    return
                self._authorize()
                if url.path == "/v1/models":
                    self._json(HTTPStatus.OK, {"object": "list", "data": [{
                        "id": model_id, "object": "model", "owned_by": "kv-elision", "created": 0,
                        "context_window": ADVERTISED_CONTEXT_WINDOW, "budget_tokens": budget_tokens,
                        "max_output_tokens": max_new_tokens}]})
                elif url.path == "/v1/kv/stats":
                    named = parse_qs(url.query).get("session", [None])[0]
                    session = checked_session(named, url.path) if named else None
                    with worker.held():
                        try:
                            stats = views.stats(worker.engine, session)
                        except KeyError:
                            raise RequestError(HTTPStatus.NOT_FOUND, f"no session {session!r} on this server",
                                               "session_not_found") from None
                    self._json(HTTPStatus.OK, stats)
                elif url.path == "/v1/kv/pages":
                    self._json(HTTPStatus.OK, self._pages(parse_qs(url.query)))
                elif url.path == "/v1/kv/score":
                    self._json(HTTPStatus.OK, self._reading(parse_qs(url.query)))
                else:
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no route {url.path}", "not_found")
            except RequestError as exc:
                self._error(exc)

        def _pages(self, query: dict[str, list[str]]) -> dict[str, Any]:
            session = self._session(query, "/v1/kv/pages")
            flag = query.get("text", ["0"])[0]
            if flag not in ("0", "1"):
                raise RequestError(HTTPStatus.BAD_REQUEST, "text must be 0 or 1")
            if flag == "1":
                self._loopback_only("page text")
            with worker.held():
                try:
                    return views.page_listing(worker.engine, session, text=flag == "1")
                except KeyError:
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no session {session!r} on this server",
                                       "session_not_found") from None

        @staticmethod
        def _session(query: dict[str, list[str]], route: str) -> str:
            session = query.get("session", [None])[0]
            if not session:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"say which session: {route}?session=ID")
            return checked_session(session, route)

        def _loopback_only(self, what: str) -> None:
            if not ipaddress.ip_address(self.client_address[0]).is_loopback:
                raise RequestError(HTTPStatus.FORBIDDEN, f"{what} is only served to loopback clients", "forbidden")

        def _reading(self, query: dict[str, list[str]]) -> dict[str, Any]:
            session = self._session(query, "/v1/kv/score")
            self._loopback_only("what a session's answer read")
            with worker.held():
                reading = answers.reading(session)
                branches = answers.branch_readings(session)
            if reading is None:
                raise RequestError(HTTPStatus.NOT_FOUND, f"no watched turn of session {session!r} has run yet",
                                   "reading_not_found")
            return {**reading.as_dict(), "branches": {name: r.as_dict() for name, r in branches.items()}}

        def _watch(self, body: Any) -> None:
            if not isinstance(body, dict) or not isinstance(body.get("session"), str) or not body["session"]:
                raise RequestError(HTTPStatus.BAD_REQUEST, 'send {"session": ID, "candidates": [answers]}')
            candidates = body.get("candidates")
            if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
                raise RequestError(HTTPStatus.BAD_REQUEST, "candidates must be a list of strings")
            names = body.get("branches", [])
            if not isinstance(names, list) or not all(isinstance(n, str) and n in SELECTORS for n in names):
                raise RequestError(HTTPStatus.BAD_REQUEST,
                                   f"branches must be a list of selector names: {', '.join(SELECTORS)}")
            session = checked_session(body["session"], "/v1/kv/score")
            if names and len(session) > MAX_ID_LENGTH - BRANCH_SUFFIX_CHARS:
                raise RequestError(HTTPStatus.BAD_REQUEST,
                                   f"a watch with branches needs a session id of at most "
                                   f"{MAX_ID_LENGTH - BRANCH_SUFFIX_CHARS} characters (each branch is a session "
                                   f"named ID-branch-<12 hex digits>); this one has {len(session)}")
            self._loopback_only("scoring a session's answers")
            with worker.held():
                try:
                    answers.watch(session, candidates, [make_selector(name, restore_pages) for name in names])
                except ValueError as exc:
                    raise RequestError(HTTPStatus.BAD_REQUEST, str(exc)) from None
            self._json(HTTPStatus.ACCEPTED, {"session": session, "watching": len(candidates)})

        def _content_length(self) -> int:
            """The body's length: one Content-Length of decimal digits (`int` also takes "-1",
            "+2" and "2_0"; -1 once read to the end of the stream, past the limit), at most
            MAX_BODY_BYTES. A body sent otherwise (chunked) is refused: where the request ends is
            then unknown, so the connection closes after the answer."""
            values = {value.strip() for value in self.headers.get_all("Content-Length", [])}
            if self.headers.get("Transfer-Encoding") is not None:
                raise RequestError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, not a "
                                   "Transfer-Encoding")
            if len(values) > 1 or not all(_DECIMAL.fullmatch(value) for value in values):
                raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must be one decimal number of bytes")
            length = int(values.pop()) if values else 0
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes")
            return length

        def _body(self, session: str | None = None) -> Any:
            """The JSON body; with a session, parsed past the messages its last body held (serving.request_body)."""
            length = self._content_length()
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                raise RequestError(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {client_timeout:g} s",
                                   "request_timeout") from None
            if len(raw) < length:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"the body ended after {len(raw)} of its {length} bytes")
            self.body_read = True
            try:
                return bodies.parse(raw or b"null", session)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError(HTTPStatus.BAD_REQUEST, "the request body is not valid JSON") from None
            except RecursionError:
                raise RequestError(HTTPStatus.BAD_REQUEST, "the request body is nested too deeply") from None

        def do_POST(self) -> None:  # noqa: N802
            with answering.held():
                self._post()

        def _post(self) -> None:
            try:
                self._content_length()   # a request whose end is unknown is refused before anything else
                self._authorize()
                path = urlparse(self.path).path
                if path == "/v1/kv/score":
                    self._watch(self._body())
                    return
                if path != "/v1/chat/completions":
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found")
                receiving = time.perf_counter()
                request, stream, include_usage = parse_chat(self._body(session_header(self.headers)), self.headers,
                                                            model_id)
                request.received_ms = (time.perf_counter() - receiving) * 1e3
                job = worker.submit(request, self._client_gone)
            except RequestError as exc:
                self.close_connection = self.close_connection or not self.body_read   # else the body reads as a request
                self._error(exc)
                return
            if stream:
                self._stream(request, job, include_usage)
            else:
                self._complete(request, job)

        def _client_gone(self) -> bool:
            """True once the client has closed its end (a readable socket that reads nothing) or
            this handler is done with the connection. The worker asks (`_Job.left`), between
            the steps of the client's turn."""
            with self.watching:
                if self.done:
                    return True
                try:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except (OSError, ValueError):
                    return True

        def _next(self, job: _Job) -> TurnEvent | RequestError:
            """The turn's next event (the worker watches the client meanwhile: `_Job.left`)."""
            while True:
                event = worker.next_event(job, CLIENT_POLL_S)
                if event is not None:
                    return event

        def _wait_prepared(self, job: _Job) -> Prepared | RequestError:
            """The first event of a turn: the prompt is in (or the turn failed before it was)."""
            event = self._next(job)
            if isinstance(event, RequestError):
                return event
            assert event.prepared is not None, "a turn announces its prompt before anything else"
            return event.prepared

        def _headers_for(self, request: ChatRequest, prepared: Prepared) -> dict[str, str]:
            headers = {"X-KV-Session": request.session_id, "X-KV-Prefilled-Tokens": str(prepared.prefilled_tokens)}
            if prepared.rebuilt:
                headers["X-KV-Rebuilt"] = prepared.rebuilt
            return headers

        def _complete(self, request: ChatRequest, job: _Job) -> None:
            prepared = self._wait_prepared(job)
            if isinstance(prepared, RequestError):
                self._error(prepared)
                return
            headers = self._headers_for(request, prepared)
            while True:
                event = self._next(job)
                if isinstance(event, RequestError):
                    self._error(event)
                    return
                if event.final is not None:
                    result = event.final
                    break
            if result.sampled:
                headers["X-KV-Sampled"] = result.sampled
            message: dict[str, Any] = {"role": "assistant", "content": result.content or None}
            if result.tool_calls:
                message["tool_calls"] = result.tool_calls
            self._json(HTTPStatus.OK, {
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_id, "choices": [{"index": 0, "message": message,
                                                "finish_reason": result.finish_reason}],
                "usage": _usage(result), "kv": result.counters.as_dict()}, headers)

        def _stream(self, request: ChatRequest, job: _Job, include_usage: bool) -> None:
            prepared = self._wait_prepared(job)
            if isinstance(prepared, RequestError):
                self._error(prepared)
                return
            self.close_connection = True
            ident = f"chatcmpl-{uuid.uuid4().hex}"
            created = int(time.time())

            def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
                payload = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_id,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
                self.wfile.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())
                self.wfile.flush()

            content = _ContentFilter()
            finished = False
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                for name, header in self._headers_for(request, prepared).items():
                    self.send_header(name, header)
                self.end_headers()
                chunk({"role": "assistant", "content": ""})
                while not finished:
                    event = self._next(job)
                    if isinstance(event, RequestError):
                        finished = True
                        error = {"error": {"message": str(event), "type": event.kind, "code": event.status.value}}
                        self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                    elif event.final is not None:
                        finished = True
                        result = event.final
                        rest = content.finish(result.content)
                        if rest:
                            chunk({"content": rest})
                        if result.tool_calls:
                            chunk({"tool_calls": [dict(call, index=n) for n, call in enumerate(result.tool_calls)]})
                        chunk({}, result.finish_reason, kv=result.counters.as_dict(),
                              **({"x_kv_sampled": result.sampled} if result.sampled else {}))
                        if include_usage:
                            payload = {"id": ident, "object": "chat.completion.chunk", "created": created,
                                       "model": model_id, "choices": [], "usage": _usage(result)}
                            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                    else:
                        text = content.feed(event.delta)
                        if text:
                            chunk({"content": text})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:   # closed, or a write waited the client timeout: the client is gone either way
                log.info("client left session %s mid-stream; ending its turn", request.session_id)
                job.gone.set()
                while not finished:
                    left = worker.next_event(job, CLIENT_POLL_S)
                    finished = left is not None and (isinstance(left, RequestError) or left.final is not None)

    return Handler


class _Listener(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` of them: past the bound a connection
    is answered 503 and closed by the accepting thread, without waiting on the client."""

    # socketserver's default backlog of 5 made the 41st of 40 stalled clients wait ~1 s for a
    # SYN retry (benchmarks.faults, health_ms); an agent with subagents opens several at once.
    request_queue_size = 128
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.open_connections = 0
        self._counting = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._counting:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed()

    def _closed(self) -> None:
        with self._counting:
            self.open_connections -= 1

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps({"error": {"message": f"the server holds {self.max_connections} connections already; "
                                                "try again", "type": "too_many_connections", "code": 503}}).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)   # a new connection's send buffer is empty: this never waits
            request.send(head + body)
        except OSError:
            pass
        log.info("refused a connection: %d open", self.max_connections)
        self.shutdown_request(request)


class Server:
    """The HTTP server and its worker, started and stopped together."""

    def __init__(self, engine: Engine, model_id: str, host: str, port: int, contextd_socket: str,
                 api_key: str | None = None, client_timeout: float = 30.0, restore_pages: int = 8,
                 stuck_after: float = STUCK_AFTER_S) -> None:
        """`restore_pages`: the most pages a selector a watch names for its branches restores;
        `stuck_after`: seconds a step of the worker may run before the server counts it stuck."""
        if client_timeout <= 0:
            raise ValueError(f"client_timeout must be positive seconds, not {client_timeout}")
        if stuck_after <= 0:
            raise ValueError(f"stuck_after must be positive seconds, not {stuck_after}")
        self.worker = Worker(engine, stuck_after)
        self.client_timeout = client_timeout
        self.answering = _Answering()
        handler = make_handler(self.worker, model_id, engine.config.budget_tokens, engine.config.max_new_tokens,
                               contextd_socket, api_key, client_timeout, restore_pages, self.answering)
        self.http = _Listener((host, port), handler, MAX_CONNECTIONS)

    @property
    def port(self) -> int:
        return int(self.http.server_address[1])

    def serve_forever(self) -> None:
        self.worker.start()
        self.http.serve_forever(poll_interval=0.2)

    def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop, draining (`kv-elision serve` on SIGTERM): no connection is accepted any more
        (the listening socket closes); turns not started are answered 503, those running may
        finish for `drain_s` seconds and are then cut (Worker.drain); the answers still being
        written are waited for (each write waits at most the client timeout). Returns once that
        is done: the caller stops contextd after it, since a turn written through needs it."""
        self.http.shutdown()      # serve_forever's loop has ended when this returns
        self.http.server_close()
        self.worker.drain(time.monotonic() + drain_s)
        self.worker.join(timeout=drain_s + WORKER_STOP_S)
        if self.worker.is_alive():
            log.warning("the worker did not end within %.0f s of the drain's deadline", WORKER_STOP_S)
        if not self.answering.wait_done(self.client_timeout):
            log.warning("answers still being written %.0f s after the worker ended", self.client_timeout)
        log.info("stopped")

    def cut_now(self) -> None:
        """During a drain: cut the turns still running without waiting for its deadline."""
        self.worker.cut_at = -math.inf
