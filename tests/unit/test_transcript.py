"""Segments and the flat views of the transcript stay in step as it grows and is cut."""

from __future__ import annotations

from serving.transcript import Fingerprint, Segment, Transcript, assistant_key


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
