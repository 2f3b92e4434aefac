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
The worker is serving.worker; what a request means and what a failure answers is
serving.http_request. Depends on those, serving.engine, serving.request_body, serving.watch and
controller.selectors.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import logging
import math
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from contextd.ids import MAX_ID_LENGTH
from controller.selectors import SELECTORS, make_selector
from serving import views
from serving.engine import Engine
from serving.http_request import RequestError, checked_session, parse_chat, session_header
from serving.request_body import BodyParser
from serving.transcript import TOOL_CALL_OPEN
from serving.turn import ChatRequest, Prepared, TurnEvent, TurnResult
from serving.watch import AnswerWatch
from serving.worker import CLIENT_POLL_S, STUCK_AFTER_S, Job, Worker

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
ADVERTISED_CONTEXT_WINDOW = 1_000_000  # the addressable session, not the attention budget
# A connection's send buffer, fixed instead of the kernel's autotuning (which may grow it to
# megabytes): a client that stops reading is noticed once this much of its answer waits for it
# and a write has then waited --client-timeout, not after thousands of tokens decoded for nobody.
# A whole streamed answer of max_new_tokens fits many times over, so a reading client never waits.
SEND_BUFFER_BYTES = 128 << 10


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
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
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
            this handler is done with the connection. The worker asks (`Job.left`), between
            the steps of the client's turn."""
            with self.watching:
                if self.done:
                    return True
                try:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except (OSError, ValueError):
                    return True

        def _next(self, job: Job) -> TurnEvent | RequestError:
            """The turn's next event (the worker watches the client meanwhile: `Job.left`)."""
            while True:
                event = worker.next_event(job, CLIENT_POLL_S)
                if event is not None:
                    return event

        def _wait_prepared(self, job: Job) -> Prepared | RequestError:
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

        def _complete(self, request: ChatRequest, job: Job) -> None:
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

        def _stream(self, request: ChatRequest, job: Job, include_usage: bool) -> None:
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

    # socketserver's default backlog of 5 made the 41st of 40 stalled clients wait for a SYN retry
    # (benchmarks.faults, health_ms: docs/journal/2026-11-30-fault-campaign.md); an agent with
    # subagents opens several at once.
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
