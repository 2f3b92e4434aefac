"""The cache's own copy of each generated answer is put back, one per message, in order."""

from __future__ import annotations

from backends.models import load_tokenizer, resolve
from serving.transcript import ChatFormat, Fingerprint, Segment, Transcript, assistant_key


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


def test_appended_and_cut_segments_keep_ids_text_and_generated_answers_in_step() -> None:
    transcript = Transcript(Fingerprint("t", "c", "x", "off"))
    transcript.append(Segment("<user>a", [1, 2]))
    transcript.append(Segment("The payment is processed", [3, 4, 5], generated=True))
    transcript.append(Segment("<user>b", [6]))
    transcript.append(Segment(" The payment is processed", [7, 8], generated=True))
    key = assistant_key("The payment is processed", [])
    assert transcript.generated == {key: ["The payment is processed", " The payment is processed"]}
    assert (transcript.ids, transcript.tokens, transcript.text_length) == ([1, 2, 3, 4, 5, 6, 7, 8], 8,
                                                                           len(transcript.text))
    transcript.cut(2)
    assert transcript.generated == {key: ["The payment is processed"]}
    assert transcript.ids == [1, 2, 3, 4, 5] and transcript.text == "<user>aThe payment is processed"
    transcript.cut(0)
    assert (transcript.generated, transcript.ids, transcript.text_length) == ({}, [], 0)
