"""Rendering with the model's chat template: generated answers put back one per message, and a
turn's render that reuses the previous one (only the new messages rendered) gives exactly the
text and message ends of a full render, or is not used."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from backends.models import load_tokenizer, resolve
from serving.chat_format import ChatFormat, Rendering
from serving.transcript import TranscriptError, assistant_key

# Qwen3's rule, reduced to it: an assistant message's <think> block is shown only after the last
# user message, so a new user message changes how an earlier answer renders.
STRIPS_EARLIER_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and '</think>' in content and loop.index0 < ns.last_user -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve("smollm2-135m"))


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatFormat:
    return ChatFormat(tokenizer)


def agent_turns(count: int) -> list[list[dict[str, Any]]]:
    """The requests of an agent session: each repeats the last and adds a tool call and its result
    or a user message (as fresh objects, the way a client's JSON arrives)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Find the port."}]
    requests = [copy.deepcopy(messages)]
    for n in range(count):
        if n % 3 == 2:
            messages += [{"role": "assistant", "content": f"Still looking ({n})."},
                         {"role": "user", "content": f"go on {n}"}]
        else:
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{n}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "f{n}"}}'}}]},
                {"role": "tool", "tool_call_id": f"c{n}", "content": f"port = {8000 + n}\n" * 20}]
        requests.append(copy.deepcopy(messages))
    return requests


def assert_same(framed: Rendering, whole: Rendering, chat: ChatFormat) -> None:
    assert framed.text == whole.text and framed.normal == whole.normal and framed.shift == whole.shift
    for after in (framed.frame_start, framed.frame_start + 1, len(framed.text) - 1):
        assert chat.message_ends(framed, after) == chat.message_ends(whole, after)


def test_two_answers_with_one_key_render_each_as_it_was_generated(chat: ChatFormat) -> None:
    # Same content once whitespace is ignored (so the same key), different raw text.
    first, second = "The payment is processed", " The payment is processed"
    key = assistant_key(first, [])
    assert key == assistant_key(second, [])
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": first.strip()},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": second.strip()},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": first.strip()}]
    normal = chat.normalize(messages, None, {key: [first, second]})
    assert [m["content"] for m in normal if m["role"] == "assistant"] == [first, second, second]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_each_turn_renders_only_its_new_messages_and_matches_a_full_render(chat: ChatFormat, tools: Any) -> None:
    assert chat.incremental
    memo = None
    for messages in agent_turns(12):
        framed = chat.render(messages, tools, "default", {}, memo)
        whole = chat.render(messages, tools, "default", {})
        assert_same(framed, whole, chat)
        if memo is not None and len(memo.normalized.normal) > 3:   # past the opening and one message
            assert framed.reused == len(memo.normalized.normal)
        memo = framed.memo


def test_gemma3_template_renders_incrementally_too() -> None:
    chat = ChatFormat(load_tokenizer(resolve("gemma3-270m")))
    assert chat.incremental
    requests = [[{"role": "system", "content": "s"}, {"role": "user", "content": "u0"}]]
    for n in range(5):
        requests.append(requests[-1] + [{"role": "assistant", "content": f"a{n}"},
                                        {"role": "user", "content": f"u{n + 1}"}])
    memo = None
    for messages in requests:
        framed = chat.render(messages, None, "default", {}, memo)
        assert_same(framed, chat.render(messages, None, "default", {}), chat)
        memo = framed.memo


def test_the_user_opening_is_what_the_template_writes_between_an_answer_and_a_question(chat: ChatFormat) -> None:
    assert chat.decode(chat.user_opening) == "<|im_end|>\n<|im_start|>user\n"
    gemma = ChatFormat(load_tokenizer(resolve("gemma3-270m")))
    assert gemma.decode(gemma.user_opening) == "<end_of_turn>\n<start_of_turn>user\n"
    # A template that writes the messages in another order has none to offer.
    backwards = ChatFormat(chat.tokenizer, "{%- for m in messages|reverse -%}{{ m.content }}|{%- endfor -%}")
    assert backwards.user_opening == []


def test_a_template_that_rerenders_earlier_messages_is_rendered_in_full(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, STRIPS_EARLIER_THINKING)
    assert not chat.incremental
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "<think>\nt\n</think>\n\na"}]
    first = chat.render(messages, None, "default", {})
    assert first.memo is None and "<think>" in first.text
    later = chat.render(messages + [{"role": "user", "content": "v"}], None, "default", {}, first.memo)
    assert "<think>" not in later.text and later.reused == 0


def test_a_memo_is_not_used_when_what_it_remembers_changed(chat: ChatFormat) -> None:
    requests = agent_turns(4)
    memo = chat.render(requests[-2], None, "default", {}).memo
    assert memo is not None
    latest = requests[-1]
    edited = copy.deepcopy(latest)
    edited[1]["content"] = "Find the host."
    answer = latest[2]
    key = assistant_key(answer["content"], answer["tool_calls"])
    regenerated = {key: ['<tool_call>\n{"name": "read", "arguments": {"path": "f0"}}\n</tool_call>']}
    for messages, tools, thinking, generated in [(edited, None, "default", {}), (latest, TOOLS, "default", {}),
                                                 (latest, None, "off", {}), (latest, None, "default", regenerated),
                                                 (latest[:len(memo.messages)], None, "default", {})]:
        framed = chat.render(messages, tools, thinking, generated, memo)
        assert framed.reused == 0
        assert_same(framed, chat.render(messages, tools, thinking, generated), chat)


def test_a_malformed_new_message_is_refused_with_a_memo_too(chat: ChatFormat) -> None:
    requests = agent_turns(2)
    memo = chat.render(requests[-2], None, "default", {}).memo
    bad = requests[-1] + [{"role": "narrator", "content": "x"}]
    with pytest.raises(TranscriptError, match=rf"messages\[{len(bad) - 1}\]: unsupported role"):
        chat.check(bad, memo)
    with pytest.raises(TranscriptError, match="non-empty list"):
        chat.check([], memo)
    chat.check(requests[-1], memo)


# Qwen2.5's rule, reduced to it: consecutive tool results share one user turn.
GROUPS_TOOL_RESULTS = (
    "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def test_a_template_that_renders_a_message_by_its_neighbours_matches_a_full_render(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, GROUPS_TOOL_RESULTS)
    assert chat.incremental
    call = {"id": "c", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                      {"role": "assistant", "content": "", "tool_calls": [call, call]},
                                      {"role": "tool", "content": "r1"}]
    memo = chat.render(messages, None, "default", {}).memo
    for added, reuses in [({"role": "tool", "content": "r2"}, False), ({"role": "user", "content": "v"}, False),
                          ({"role": "assistant", "content": "a"}, True), ({"role": "tool", "content": "r3"}, True)]:
        messages = messages + [added]
        framed = chat.render(messages, None, "default", {}, memo)
        assert_same(framed, chat.render(messages, None, "default", {}), chat)
        assert (framed.reused > 0) is reuses, added
        memo = framed.memo


def test_values_equal_in_python_but_rendered_differently_are_changes(chat: ChatFormat) -> None:
    def calling(argument: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read", "arguments": {"x": argument}}}]}

    user, result = {"role": "user", "content": "u"}, {"role": "tool", "content": "r"}
    for before, after in [(1, True), (1, 1.0), (0.0, -0.0)]:
        memo = chat.render([user, calling(before), result], None, "default", {}).memo
        messages = [user, calling(after), result, {"role": "user", "content": "v"}]
        framed = chat.render(messages, None, "default", {}, memo)
        assert framed.reused == 0
        assert_same(framed, chat.render(messages, None, "default", {}), chat)


def test_a_template_that_reads_the_clock_is_rendered_in_full(tokenizer: Any) -> None:
    dated = "{{ strftime_now('%d %b %Y') }}" + STRIPS_EARLIER_THINKING.replace("'<think>'", "'x'")
    assert not ChatFormat(tokenizer, dated).incremental
