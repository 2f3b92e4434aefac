"""The cache's own copy of each generated answer is put back, one per message, in order."""

from __future__ import annotations

from backends.models import load_tokenizer, resolve
from backends.transcript import ChatFormat, Fingerprint, Transcript, assistant_key


def test_two_answers_with_one_key_render_each_as_it_was_generated() -> None:
    chat = ChatFormat(load_tokenizer(resolve("smollm2-135m")))
    # Same content once whitespace is ignored (so the same key), different raw text.
    first, second = "The payment is processed", " The payment is processed"
    key = assistant_key(first, [])
    assert key == assistant_key(second, [])
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": first.strip()},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": second.strip()},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": first.strip()}]
    normal = chat.normalize(messages, None, {key: [first, second]})
    assert [m["content"] for m in normal if m["role"] == "assistant"] == [first, second, second]


def test_a_record_from_before_lists_still_loads() -> None:
    record = Transcript(Fingerprint("t", "c", "x", "off"), generated={"k": ["raw"]}).to_record()
    assert Transcript.from_record(record).generated == {"k": ["raw"]}
    record["generated"] = {"k": "raw"}  # the format of earlier versions: one raw text per key
    assert Transcript.from_record(record).generated == {"k": ["raw"]}
