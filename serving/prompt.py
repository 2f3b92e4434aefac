"""A turn's new text as pieces, one per message: what each is pinned as, whether it closes a tool
call, whether the user wrote it, and what the eviction orders learn as each begins.

One message a segment, so that a later edit of the client's history keeps every message before it
(serving.transcript cuts back at segment ends). Apart from the engine because the probe
(serving.probe) prefills a question exactly as a turn does. Depends on serving.chat_format,
serving.session, serving.transcript, serving.turn and contextd.wire's pin kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextd.wire import PinKind
from serving.chat_format import ChatFormat, Rendering, content_text
from serving.session import Session
from serving.transcript import Segment
from serving.turn import ChatRequest


@dataclass(frozen=True)
class PromptPiece:
    """One message's share of the new text: its tokens, the hard pin it gets, whether it closes a
    tool call, whether the user wrote it (the eviction advice's focus)."""

    segment: Segment
    pin: PinKind | None
    tool_call: bool
    from_user: bool


def piece_texts(chat_format: ChatFormat, rendering: Rendering, text: str, messages: int) -> list[tuple[str, int]]:
    """The new `text` at the end of the render, cut where each message ends: (piece, index of
    its message, or `messages` for the template's opening of the answer after the last one)."""
    rendered = rendering.text
    start = len(rendered) - len(text)
    cut = start
    pieces = []
    for offset, index in [*chat_format.message_ends(rendering, start), (len(rendered), messages)]:
        if rendered[cut:offset]:
            pieces.append((rendered[cut:offset], index))
        cut = offset
    return pieces


def prompt_pieces(chat_format: ChatFormat, session: Session, request: ChatRequest, rendering: Rendering,
                  text: str) -> list[PromptPiece]:
    """Tokenize the new text in one segment per message, so a later edit keeps every message
    before it. On a fresh session the system message (with the tool schemas a template puts
    there) and everything up to the end of the first user message (the objective) are pinned."""
    if not text:
        return []
    first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), -1)
    fresh = session.transcript.tokens == 0
    pieces: list[PromptPiece] = []
    for piece, index in piece_texts(chat_format, rendering, text, len(request.messages)):
        # After the last message: the template's opening of the assistant's turn.
        opener = index == len(request.messages)
        message = request.messages[index] if not opener else {}
        pin = None
        if fresh and index <= first_user:
            opening = message.get("role") in ("system", "developer")
            pin = (PinKind.TOOLS if request.tools else PinKind.SYSTEM) if opening else PinKind.OBJECTIVE
        tool_call = message.get("role") == "assistant" and bool(message.get("tool_calls"))
        pieces.append(PromptPiece(Segment(piece, chat_format.encode(piece), opener=opener), pin, tool_call,
                                  message.get("role") == "user"))
    return pieces


def keep_focus(chat_format: ChatFormat, session: Session, request: ChatRequest) -> None:
    """A session whose eviction advice has no focus (new, restarted, adopted, branched, or
    rebuilt after a failed turn) takes the last user message the request carries: in a tool
    loop the next user message may be many turns away."""
    advisor = session.eviction
    if advisor is None or advisor.focus:
        return
    asked = next((m for m in reversed(request.messages) if m.get("role") == "user"), None)
    if asked is not None:
        advisor.set_focus(chat_format.encode(content_text(asked.get("content"), "the last user message")))


def begin_message(session: Session, piece: PromptPiece) -> None:
    """A user message's words are the eviction advice's focus from that message on: the room
    its own prefill needs is made by it, the earlier pieces' was not. For the attention
    order, a message starts (a user's votes)."""
    if piece.from_user and session.eviction is not None:
        session.eviction.set_focus(piece.segment.ids)
    if session.attention is not None:
        session.attention.begin_message(piece.from_user)
