"""The chat transcript as the model sees it: segments, alignment with the cache, fingerprints.

The client (Pi) owns the transcript and sends all of it every turn. The cache holds tokens that
spell one exact text: the rendered prompts of earlier turns plus the raw text the model generated.
Each turn we render the new transcript and check that the cached text is a prefix of it; only the
rest is tokenized and prefilled.

The trap this module exists for: the client sends the assistant's reply back as *text* (or as
parsed tool calls), and re-tokenizing that text need not give the generated ids. So the cache's
own record of what was generated is substituted for the client's copy of that message before
rendering, whenever the two agree, and the generated tokens are never prefilled again.

Fail closed: the cache is trusted only while the tokenizer, the chat template, the tool schemas
and the thinking mode are those that built it and the cached text is a prefix of the new render.
Otherwise `align` says how much can be kept (whole segments before the first difference) and why.

Rendering the client's messages with the chat template is serving.chat_format's. Depends on
xxhash only.
"""

from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass
from typing import Any

import xxhash

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(\{.*?\})\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class TranscriptError(ValueError):
    """The request's messages cannot be rendered (a 400 for the client, never a crash)."""


def digest(value: Any) -> str:
    """16 hex digits of xxh64 over a canonical JSON form."""
    return xxhash.xxh64_hexdigest(json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())


def tool_call_text(call: dict[str, Any]) -> str:
    """One tool call in the format the model is taught to emit (and this module parses back)."""
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": fn.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into plain content and OpenAI-style tool calls."""
    calls = []
    for n, match in enumerate(_TOOL_CALL.finditer(text)):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", {})
        calls.append({"id": f"call_{xxhash.xxh64_hexdigest(text.encode())[:8]}_{n}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return content, calls


def assistant_key(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """Identity of an assistant message as the client will send it back (whitespace-insensitive)."""
    names = [(c.get("function", c).get("name", ""), _normal_arguments(c.get("function", c).get("arguments", "")))
             for c in tool_calls]
    return digest({"content": content.strip(), "calls": names})


def _normal_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


@dataclass(frozen=True)
class Fingerprint:
    """Everything besides the messages that decides what the cached tokens mean."""

    tokenizer: str
    template: str
    tools: str
    thinking: str

    def differences(self, other: Fingerprint) -> list[str]:
        names = ("tokenizer", "template", "tools", "thinking")
        return [f"{n} changed" for n in names if getattr(self, n) != getattr(other, n)]

    def combined(self) -> str:
        return digest([self.tokenizer, self.template, self.tools, self.thinking])


@dataclass
class Segment:
    """A run of cached tokens and the exact text they spell: one client message, the template's
    opening of the assistant's turn (`opener`, rendered anew at the end of every prompt), or an
    answer the model generated (`generated`)."""

    text: str
    ids: list[int]
    generated: bool = False
    opener: bool = False


@dataclass(frozen=True)
class Alignment:
    """How a new render lines up with the cache: the first `keep_segments` segments stay, the
    rest leave attention (no forward pass: a truncation), `new_text` is prefilled.

    `reason` says why the client's own history no longer matches ("" when it does). Dropping
    only the cache's own answers and the turn openers before them is no such change: that is a
    client that did not replay an answer (Pi omits an answer cut at its length limit or aborted)
    or that retries one, and it is served as a tail drop, without a rebuild."""

    keep_segments: int
    keep_tokens: int
    new_text: str
    reason: str = ""

    @property
    def rebuild(self) -> bool:
        return bool(self.reason)


class Transcript:
    """The cache's side of the conversation for one session: segments that spell the cached
    tokens exactly, appended and cut through `append` / `cut` so the flat views stay in step."""

    def __init__(self, fingerprint: Fingerprint, segments: list[Segment] | None = None,
                 message_hashes: list[str] | None = None) -> None:
        self.fingerprint = fingerprint
        self.message_hashes = list(message_hashes or [])  # the client's per-message hashes, if sent
        self.segments: list[Segment] = []
        self._ids: list[int] = []
        # xxh64 of the token ids up to each segment's end, kept as the segments come: names the
        # stream a recurrent snapshot folded in without hashing the whole transcript each turn.
        self._prefix_hashers: list[xxhash.xxh64] = []
        self._text_length = 0
        # assistant_key -> the raw texts generated under it, oldest first. A list because two
        # answers can share a key (the key ignores whitespace) yet differ in their raw text: the
        # n-th message with a key is given the n-th raw text, so each renders exactly as generated.
        self.generated: dict[str, list[str]] = {}
        for segment in segments or []:
            self.append(segment)

    def append(self, segment: Segment) -> None:
        self.segments.append(segment)
        self._ids.extend(segment.ids)
        hasher = self._prefix_hashers[-1].copy() if self._prefix_hashers else xxhash.xxh64()
        hasher.update(array("q", segment.ids).tobytes())
        self._prefix_hashers.append(hasher)
        self._text_length += len(segment.text)
        if segment.generated:
            content, calls = parse_tool_calls(segment.text)
            self.generated.setdefault(assistant_key(content, calls), []).append(segment.text)

    def cut(self, keep: int) -> None:
        """Keep the first `keep` segments (and the generated answers among them)."""
        for segment in self.segments[keep:]:
            if segment.generated:
                content, calls = parse_tool_calls(segment.text)
                raws = self.generated[assistant_key(content, calls)]
                raws.remove(segment.text)
                if not raws:
                    del self.generated[assistant_key(content, calls)]
        del self.segments[keep:]
        del self._prefix_hashers[keep:]
        self._ids = self._ids[:sum(len(s.ids) for s in self.segments)]
        self._text_length = sum(len(s.text) for s in self.segments)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def text_length(self) -> int:
        return self._text_length

    @property
    def ids(self) -> list[int]:
        """Every cached token id in order (the transcript's own list: read, never modify)."""
        return self._ids

    @property
    def tokens(self) -> int:
        return len(self._ids)

    def prefix_hash(self, tokens: int) -> str | None:
        """16 hex digits of xxh64 over the first `tokens` token ids when a segment ends there, else
        None: names the stream a recurrent state folded in, so a state is never resumed on a
        transcript that differs before it."""
        end = self.tokens  # snapshots sit near the end: walk back from it
        for segment, hasher in zip(reversed(self.segments), reversed(self._prefix_hashers), strict=True):
            if end == tokens:
                return hasher.hexdigest()
            if end < tokens:
                return None
            end -= len(segment.ids)
        return xxhash.xxh64().hexdigest() if tokens == 0 else None

    def last_opener_start(self) -> int | None:
        """Tokens before the newest turn opener: where a re-sent turn resumes to answer again."""
        end = self.tokens
        for segment in reversed(self.segments):
            end -= len(segment.ids)
            if segment.opener:
                return end
        return None


CHANGED_TEXT = "transcript changed before the cached end (edited or retried)"


def align(transcript: Transcript, fingerprint: Fingerprint, rendered: str,
          message_hashes: list[str] | None = None) -> Alignment:
    """How much of the cache a new render keeps, and the text still to prefill."""
    if not transcript.segments:
        return Alignment(0, 0, rendered)
    changed = transcript.fingerprint.differences(fingerprint)
    if changed:
        return Alignment(0, 0, rendered, reason=", ".join(changed))
    if message_hashes is not None and transcript.message_hashes:
        seen = transcript.message_hashes
        if message_hashes[:len(seen)] != seen:
            padded = message_hashes + [""] * len(seen)
            at = next(i for i, (a, b) in enumerate(zip(seen, padded, strict=False)) if a != b)
            reason = f"client history changed at message {at}"
            return _keep_common_prefix(transcript, rendered, reason)
    cached = transcript.text
    if rendered.startswith(cached):
        return Alignment(len(transcript.segments), transcript.tokens, rendered[len(cached):])
    return _keep_common_prefix(transcript, rendered, CHANGED_TEXT)


def _keep_common_prefix(transcript: Transcript, rendered: str, reason: str) -> Alignment:
    kept_chars = kept_tokens = 0
    keep = 0
    for segment in transcript.segments:
        end = kept_chars + len(segment.text)
        if rendered[kept_chars:end] != segment.text:
            break
        kept_chars, kept_tokens, keep = end, kept_tokens + len(segment.ids), keep + 1
    if reason == CHANGED_TEXT and all(s.generated or s.opener for s in transcript.segments[keep:]):
        reason = ""
    return Alignment(keep, kept_tokens, rendered[kept_chars:], reason=reason)


def recomputed_tokens(dropped: list[Segment], new_text: str) -> int:
    """Tokens of dropped segments whose text comes back, in order, in the text to prefill: what
    a rebuild computes a second time. Turn openers are rendered anew every turn, so they never count."""
    cursor = 0
    count = 0
    for segment in dropped:
        if segment.opener or not segment.text:
            continue
        found = new_text.find(segment.text, cursor)
        if found >= 0:
            count += len(segment.ids)
            cursor = found + len(segment.text)
    return count
