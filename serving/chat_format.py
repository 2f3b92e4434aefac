"""Rendering a client's messages with the model's own chat template, in time that follows what is
new rather than the whole transcript.

Pi sends the whole transcript every turn. Normalizing and rendering all of it, then rendering
every prefix again to find where the new messages end, cost time every turn that grew with the
session (a 2.9M-character transcript with SmolLM2's template: docs/journal/2026-11-30-scale.md).
So a render leaves a `RenderMemo`, and a next request that repeats those messages and adds some
normalizes and renders only the added ones, in a *frame*: the conversation's opening (system and
first user message, which templates treat specially), the last remembered message, then the new
messages. What the frame renders after the last remembered message is what the whole render has
after the remembered text.

That holds for templates that render each message by itself and its neighbours. Neighbours are
checked every turn: the last remembered message must render in the frame, followed by the new
ones, exactly as the memo's text ends (Qwen2.5 groups consecutive tool results under one turn, so
a tool result after a tool result is rendered whole). The rest `ChatFormat` checks once, on probe
conversations: every split of each, with and without tools, thinking on, off and by default,
including an assistant message with a `<think>` block (Qwen3-style templates render one
differently once a later user message exists) and consecutive tool results. A template that fails
any probe, or reads the clock, is rendered in full every turn. A memo is also unused (a full
render) whenever an earlier message (compared with types: 1 is not 1.0 or true), the tools, the
thinking mode or the cache's copy of an earlier generated answer differs.

Depends on serving.transcript (message helpers, Fingerprint), controller.lexical (vocabulary
bytes) and a tokenizer object (encode / decode / apply_chat_template).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from controller.lexical import vocabulary_bytes
from serving.transcript import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Fingerprint,
    TranscriptError,
    assistant_key,
    digest,
    tool_call_text,
)

# Tokens that end a model's turn in the chat formats served here (whichever the vocabulary has).
TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>")
# The one tool schema of the conversations a ChatFormat renders both ways when it is built.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}}}}]


def content_text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of parts of which only text is supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TranscriptError(f"{where}: content part of type {kind!r} is not supported (text only)")
            pieces.append(str(part.get("text", "")))
        return "".join(pieces)
    raise TranscriptError(f"{where}: content must be a string or a list of text parts")



def _same(a: Any, b: Any) -> bool:
    """JSON values equal as the template sees them: identical objects (a request body parser
    hands back the last request's), or equal with the same types, key order and float sign
    (Python's `==` takes 1, 1.0 and True for one another, which render differently)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(value, b[key]) for key, value in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)


@dataclass(frozen=True)
class Normalized:
    """Messages in the form the template renders, and what normalizing more of them needs."""

    normal: list[dict[str, str]]
    occurrences: dict[str, int]          # assistant key -> messages with that key so far
    used: dict[str, tuple[str, ...]]     # assistant key -> the cache's raw answers it was given


@dataclass(frozen=True)
class RenderMemo:
    """What one render leaves for the next turn's: the messages as the client sent them, their
    normalized form and the template's render of them without the generation prompt."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: str
    normalized: Normalized
    text: str

    def repeated_by(self, messages: list[dict[str, Any]]) -> bool:
        """`messages` begins with every remembered message, unchanged, and adds at least one."""
        held = len(self.messages)
        return len(messages) > held and _same(messages[:held], self.messages)

    def reusable(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: str,
                 generated: dict[str, list[str]]) -> bool:
        """The remembered render is the start of `messages`' render: same messages, tools, thinking
        mode, and the same generated answers put back into them."""
        return (_same(tools, self.tools) and thinking == self.thinking and self.repeated_by(messages)
                and all(tuple(generated.get(key, ())) == raws for key, raws in self.normalized.used.items()))


@dataclass(frozen=True)
class Rendering:
    """A transcript rendered with the chat template, and how: in full, or as a remembered prefix
    (`reused` normalized messages) followed by the part of a frame after the last of them."""

    text: str
    normal: list[dict[str, str]]    # the normalized messages
    shift: int                      # 1 when normalization put a system message in front, else 0
    tools: list[dict[str, Any]] | None
    thinking: str
    memo: RenderMemo | None         # for the next turn's render; None where the template is rendered in full
    frame: str                      # the frame's render (the whole `text` for a full render)
    reused: int = 0                 # leading normalized messages whose render came from a memo
    opening: int = 0                # normalized messages the frame renders before the last remembered one
    frame_start: int = 0            # where the new messages' render begins in `text` (the memo's end)
    frame_offset: int = 0           # a position in `frame` plus this is the same position in `text`


class ChatFormat:
    """Renders OpenAI chat messages with the model's own chat template."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        found = template or getattr(tokenizer, "chat_template", None)
        if not found:
            raise TranscriptError("the tokenizer has no chat template; pass one explicitly")
        self.template: str = str(found)
        vocab = sorted(tokenizer.get_vocab().items())
        self.tokenizer_id = digest([vocab, getattr(tokenizer, "all_special_tokens", [])])
        self.template_id = digest(self.template)
        # Templates that know nothing of tools get the tool schemas in the system message instead.
        self.native_tools = "tools" in self.template
        self._special_tokens: dict[str, Any] = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        self._compiled: Any = None
        self._compiled = self._direct_renderer()
        # A template that reads the clock (strftime_now: Llama 3's date line) renders the same
        # messages differently from one day to the next: it is rendered whole every turn.
        self.incremental = "strftime_now" not in self.template and self._frames_match()

    def fingerprint(self, tools: list[dict[str, Any]] | None, thinking: str) -> Fingerprint:
        return Fingerprint(self.tokenizer_id, self.template_id, digest(tools or []), thinking)

    # ------------------------------------------------------------------ normalizing

    def normalize(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  generated: dict[str, list[str]]) -> list[dict[str, str]]:
        """Flatten content parts, write tool calls as text, and put back the cache's own copy of
        every assistant message the model generated."""
        return self._normalize(messages, tools, generated, None).normal

    def check(self, messages: list[dict[str, Any]], memo: RenderMemo | None) -> None:
        """Raise TranscriptError for a malformed request, before any work; the messages a memo
        holds were checked when they came."""
        if not isinstance(messages, list) or not messages:
            raise TranscriptError("messages must be a non-empty list")
        start = len(memo.messages) if memo is not None and memo.repeated_by(messages) else 0
        for n in range(start, len(messages)):
            self._normal_message(n, messages[n], {}, {}, {})

    def _normalize(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   generated: dict[str, list[str]], memo: RenderMemo | None) -> Normalized:
        """Normalize `messages`, after the ones `memo` holds (all of them without one)."""
        if not isinstance(messages, list) or not messages:
            raise TranscriptError("messages must be a non-empty list")
        if memo is None:
            out: list[dict[str, str]] = []
            occurrences: dict[str, int] = {}
            used: dict[str, tuple[str, ...]] = {}
        else:
            out = list(memo.normalized.normal)
            occurrences, used = dict(memo.normalized.occurrences), dict(memo.normalized.used)
        for n in range(0 if memo is None else len(memo.messages), len(messages)):
            out.append(self._normal_message(n, messages[n], generated, occurrences, used))
        if memo is None and tools and not self.native_tools:
            listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
            preamble = ("You can call tools. Available tools, one JSON schema per line:\n" + listing +
                        f"\nTo call a tool, answer with {TOOL_CALL_OPEN}{{\"name\": ..., \"arguments\": {{...}}}}"
                        f"{TOOL_CALL_CLOSE}.")
            if out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return Normalized(out, occurrences, used)

    @staticmethod
    def _normal_message(n: int, message: Any, generated: dict[str, list[str]], occurrences: dict[str, int],
                        used: dict[str, tuple[str, ...]]) -> dict[str, str]:
        """Message n as {role, content}; an assistant message the model generated gets the cache's
        raw text (the k-th message with a key gets the k-th answer generated under it)."""
        if not isinstance(message, dict):
            raise TranscriptError(f"messages[{n}] is not an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise TranscriptError(f"messages[{n}]: unsupported role {role!r}")
        text = content_text(message.get("content"), f"messages[{n}]")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise TranscriptError(f"messages[{n}].tool_calls must be a list")
            for k, call in enumerate(calls):
                function = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name", ""), str):
                    raise TranscriptError(f"messages[{n}].tool_calls[{k}] must be an object with a "
                                          "`function` object that has a string `name`")
            key = assistant_key(text, calls)
            raws = generated.get(key)
            used[key] = tuple(raws or ())
            seen = occurrences[key] = occurrences.get(key, 0) + 1
            if raws:
                text = raws[min(seen, len(raws)) - 1]
            elif calls:
                text = "\n".join([text.strip()] * bool(text.strip()) + [tool_call_text(c) for c in calls])
        return {"role": role, "content": text}

    # ------------------------------------------------------------------ rendering

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: str,
               generated: dict[str, list[str]], memo: RenderMemo | None = None) -> Rendering:
        """The whole transcript as the model sees it; with the previous turn's memo, only the
        messages after it are normalized and rendered."""
        if memo is not None and self.incremental and memo.reusable(messages, tools, thinking, generated):
            normalized = self._normalize(messages, tools, generated, memo)
            framed = self._render_framed(normalized, memo, tools, thinking)
            if framed is not None:
                text, body, frame, opening, frame_offset = framed
                return Rendering(text, normalized.normal, len(normalized.normal) - len(messages), tools, thinking,
                                 RenderMemo(list(messages), tools, thinking, normalized, body), frame,
                                 reused=len(memo.normalized.normal), opening=opening, frame_start=len(memo.text),
                                 frame_offset=frame_offset)
        normalized = self._normalize(messages, tools, generated, None)
        normal = normalized.normal
        prompt = normal[-1]["role"] != "assistant"
        text = self._render(normal, tools, thinking, add_generation_prompt=prompt)
        fresh = None
        if self.incremental:
            body = self._render(normal, tools, thinking, add_generation_prompt=False) if prompt else text
            fresh = RenderMemo(list(messages), tools, thinking, normalized, body)
        # Normalization may put a system message in front for the tool schemas: message n is normal[n + shift].
        return Rendering(text, normal, len(normal) - len(messages), tools, thinking, fresh, text)

    @staticmethod
    def _opening(normal: list[dict[str, str]], reused: int) -> int | None:
        """How many leading messages a frame renders before the last remembered one: through the
        first non-system message, one more where needed to keep the parity of the messages'
        positions (templates that check user/assistant alternation by index), never into the
        last remembered message."""
        first = next((i for i, m in enumerate(normal) if m["role"] != "system"), len(normal))
        opening = first + 1 + (first + 2 - reused) % 2
        return opening if opening <= reused - 1 else None

    def _render_framed(self, normalized: Normalized, memo: RenderMemo, tools: list[dict[str, Any]] | None,
                       thinking: str) -> tuple[str, str, str, int, int] | None:
        """(text, text without the generation prompt, frame, opening, frame offset), or None where
        the frame does not render as the remembered text plus the new messages. The frame holds
        the last remembered message too, and its render there must be the memo's ending: a
        template that renders a message by its neighbours (Qwen2.5 groups consecutive tool
        results under one turn) fails that check when the neighbours matter, and is rendered whole."""
        normal = normalized.normal
        reused = len(memo.normalized.normal)
        opening = self._opening(normal, reused)
        if opening is None:
            return None
        context, framed = normal[:opening], normal[:opening] + normal[reused - 1:]
        prompt = normal[-1]["role"] != "assistant"
        try:
            base = self._render(context, tools, thinking, add_generation_prompt=False)
            held = self._render(context + [normal[reused - 1]], tools, thinking, add_generation_prompt=False)
            body = self._render(framed, tools, thinking, add_generation_prompt=False)
            frame = self._render(framed, tools, thinking, add_generation_prompt=True) if prompt else body
        except TranscriptError:
            return None   # rendered in full, which raises if the request itself is at fault
        if not (held.startswith(base) and memo.text.endswith(held[len(base):]) and body.startswith(held)
                and frame.startswith(body)):
            return None
        whole_body = memo.text + body[len(held):]
        return whole_body + frame[len(body):], whole_body, frame, opening, len(memo.text) - len(held)

    def _render(self, normal: list[dict[str, str]], tools: list[dict[str, Any]] | None, thinking: str,
                add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        if self.native_tools and tools:
            kwargs["tools"] = tools
        if thinking in ("on", "off"):
            kwargs["enable_thinking"] = thinking == "on"
        try:
            if self._compiled is not None:
                return str(self._compiled.render(messages=normal, documents=None, **self._special_tokens,
                                                 **{"tools": None, **kwargs}))
            return str(self.tokenizer.apply_chat_template(normal, chat_template=self.template, tokenize=False,
                                                          **kwargs))
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise TranscriptError(f"the chat template could not render these messages: {exc}") from None

    def _direct_renderer(self) -> Any:
        """The chat template compiled once and rendered directly: transformers'
        `apply_chat_template` copies and converts every message first, which made a
        million-token transcript's render several times slower (docs/journal/2026-11-30-scale.md).
        Used only when it renders probe conversations (with and without tools, thinking on and
        off) exactly as `apply_chat_template` does."""
        from transformers.utils.chat_template_utils import _compile_jinja_template

        try:
            compiled = _compile_jinja_template(self.template)
        except Exception:  # noqa: BLE001 - a template transformers cannot compile here renders the slow way
            return None
        self._compiled = compiled
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
        for tools in (None, _PROBE_TOOLS):
            for thinking in ("default", "on", "off"):
                for end in (3, 4):
                    direct = self._render(probe[:end], tools, thinking, add_generation_prompt=end == 4)
                    self._compiled = None
                    slow = self._render(probe[:end], tools, thinking, add_generation_prompt=end == 4)
                    self._compiled = compiled
                    if direct != slow:
                        return None
        return compiled

    def _frames_match(self) -> bool:
        """Whether this template renders every probe conversation, split anywhere, the same framed
        as in full, with the same message ends (see the module docstring)."""
        think = "<think>\nweighing it\n</think>\n\nanswer two"
        call = tool_call_text({"function": {"name": "f", "arguments": {"x": "1"}}})
        system, users = {"role": "system", "content": "s"}, [{"role": "user", "content": f"u{i}"} for i in range(4)]
        answers = [{"role": "assistant", "content": a} for a in ("a1", think, "a3")]
        conversations = [
            [system, users[0], answers[0], users[1], answers[1], users[2], answers[2], users[3]],
            [users[0], answers[0], users[1], answers[1], users[2]],
            [system, users[0], {"role": "assistant", "content": think + "\n" + call}, {"role": "tool", "content": "r"},
             {"role": "tool", "content": "r2"}, answers[0], users[1], users[2],
             {"role": "assistant", "content": call}, {"role": "tool", "content": "r3"}],
        ]
        # `enable_thinking` reaches the template only as a variable: one that never reads it
        # renders the same for all three modes.
        modes = ("default", "on", "off") if "enable_thinking" in self.template else ("default",)
        self.incremental = True
        try:
            for tools in (None, _PROBE_TOOLS):
                for thinking in modes:
                    for conversation in conversations:
                        for end in (len(conversation) - 1, len(conversation)):
                            if not self._splits_match(conversation[:end], tools, thinking):
                                return False
        finally:
            self.incremental = False
        return True

    def _splits_match(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      thinking: str) -> bool:
        try:
            whole = self.render(messages, tools, thinking, {})
        except TranscriptError:
            whole = None
        for held in range(1, len(messages)):
            try:
                memo = self.render(messages[:held], tools, thinking, {}).memo
            except TranscriptError:
                continue   # no turn leaves a memo of messages the template refuses
            assert memo is not None
            try:
                framed = self.render(messages, tools, thinking, {}, memo)
            except TranscriptError:
                if whole is None:
                    continue
                return False
            if whole is None or framed.text != whole.text or framed.normal != whole.normal:
                return False
            for after in (framed.frame_start, framed.frame_start + 1):
                if self.message_ends(framed, after) != self.message_ends(whole, after):
                    return False
        return True

    def message_ends(self, rendering: Rendering, after: int) -> list[tuple[int, int]]:
        """(character offset in the rendering, message index) where each message after offset
        `after` ends, newest last; the last message's end is where the turn opener starts. Only
        offsets where the template renders prefixes stably are returned."""
        if rendering.reused and after >= rendering.frame_start:
            context, new = rendering.normal[:rendering.opening], rendering.normal[rendering.reused - 1:]
            frame, offset = rendering.frame, rendering.frame_offset
        else:
            context, new, frame, offset = [], rendering.normal, rendering.text, 0
        first = len(rendering.normal) - len(new) - rendering.shift   # client index of new[0]
        ends: list[tuple[int, int]] = []
        for count in range(len(new), 0, -1):
            index = first + count - 1
            if index < 0:
                break
            try:
                prefix = self._render(context + new[:count], rendering.tools, rendering.thinking,
                                      add_generation_prompt=False)
            except TranscriptError:  # a prefix the template refuses is simply not a boundary
                continue
            if offset + len(prefix) <= after:
                break
            if frame.startswith(prefix) and len(prefix) < len(frame):
                ends.append((offset + len(prefix), index))
        return sorted(ends)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end an answer: the tokenizer's end of sequence and the turn ends of the
        chat formats served here (ChatML's `<|im_end|>`, `<|endoftext|>`, Gemma's
        `<end_of_turn>`), those this vocabulary has."""
        tokenizer = self.tokenizer
        unknown = getattr(tokenizer, "unk_token_id", -1)
        found = (tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in TURN_ENDS))
        return frozenset(int(t) for t in found if t is not None and int(t) >= 0 and int(t) != unknown)

    @cached_property
    def template_ids(self) -> list[int]:
        """The ids the chat template writes around every message (role markers, the newline after
        a role), found by rendering empty messages of every role: they say nothing about what a
        page holds, so the lexical index leaves them out (controller.lexical)."""
        ids: set[int] = set()
        for role in ("user", "assistant", "tool"):
            for opener in (False, True):
                text = self._render([{"role": "system", "content": ""}, {"role": role, "content": ""}], None,
                                    "default", add_generation_prompt=opener)
                ids.update(self.encode(text))
        return sorted(ids)

    @cached_property
    def user_opening(self) -> list[int]:
        """The ids the chat template writes between an answer's last word and the next user
        message's first (ChatML: `<|im_end|>`, a newline, `<|im_start|>user`, a newline), found by
        rendering marked messages; [] when the template refuses them or does not render them in
        order. Page scoring puts them before the question, so the model reads the question as a new
        turn rather than a continuation of the page's last line (docs/controller.md, seed 109's
        near-duplicate miss)."""
        answer, question = "kv-elision-answer", "kv-elision-question"
        try:
            text = self._render([{"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
                                 {"role": "user", "content": question}], None, "default", add_generation_prompt=False)
        except TranscriptError:   # a template that refuses the probe: the question straight after the page
            return []
        start = text.find(answer)
        end = text.find(question, start + len(answer)) if start >= 0 else -1
        return self.encode(text[start + len(answer):end]) if end >= 0 else []

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (for byte n-grams across token boundaries, controller.lexical). A
        vocabulary whose pieces carry GPT-2's stand-in for a space (U+0120) is byte-level BPE."""
        vocab: dict[str, int] = self.tokenizer.get_vocab()
        pieces = [""] * (max(vocab.values()) + 1)
        for piece, i in vocab.items():
            pieces[i] = piece
        byte_level = any(p.startswith(chr(0x120)) for p in pieces)
        return vocabulary_bytes(pieces, byte_level)


