"""What a chat request means, and what a failed one answers: the body and headers validated into
an engine request (`parse_chat`), session ids checked as contextd checks them (`checked_session`),
and the HTTP status of each exception out of a turn (`ERROR_STATUS`, `error_for`).

Kept apart from the HTTP handler so that the worker (serving.worker) and the reliability campaign's
oracle read the same map without the server around it. Depends on serving.transcript, serving.turn
and contextd's errors and ids; nothing here touches a socket.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

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
from serving.transcript import TranscriptError, digest
from serving.turn import ChatRequest


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind




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
