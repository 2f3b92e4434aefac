"""A turn's answer, token by token (`Decoder`): each picked token is fed back so the cache spells
exactly the answer, text is streamed as whole characters, a decode step pauses for the worker's
batched forward, and the fixed point (a greedy answer repeating the previous turn's) is sampled
away.

Apart from the engine because decoding is its own step of the turn, after the view is planned:
it reads the cache being served through the page mover (`PageMover.backend`, which the engine
points at the session's cache before each step) and makes room a token at a time. Depends on
serving.paging, serving.session, serving.transcript, serving.turn, serving.chat_format and
backends (the decode step, the sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import numpy as np

from backends import DecodeStep
from backends.slots import pick_token
from contextd import crashpoints
from serving.chat_format import ChatFormat
from serving.paging import PageMover
from serving.session import LastAnswer, Session, Tally
from serving.transcript import Segment
from serving.turn import ChatRequest, FinishReason, TurnEvent

# What a tokenizer decodes a partial UTF-8 sequence to; such text is held back from the stream.
INCOMPLETE_CHARACTER = chr(0xFFFD)


class Decoder:
    """Decodes the answers of the turns the engine runs (one per engine)."""

    def __init__(self, mover: PageMover, chat_format: ChatFormat, tally: Tally, fixed_point_seed: int) -> None:
        self.mover = mover
        self.format = chat_format
        self.tally = tally
        self.fixed_point_seed = fixed_point_seed
        self.stop_ids = chat_format.stop_ids

    def generate(self, session: Session, request: ChatRequest, prompt_ids: list[int], limit: int
                 ) -> Generator[TurnEvent, int | None, tuple[list[int], FinishReason, str]]:
        """The turn's answer, at most `limit` tokens: greedy or sampled as the request asks, and
        sampled (seeded, said in the result) where greedy decoding would repeat the previous turn's
        answer to the same prompt. Returns the tokens picked, why it ended, and that note."""
        greedy = request.temperature <= 0.0
        previous = session.last_answer
        repeated = greedy and previous is not None and previous.prompt_ids == prompt_ids
        repeat_of = previous.answer_ids if repeated and previous is not None else None
        prompt_logits = self.mover.backend.last_logits()
        segments_before = len(session.transcript.segments)
        picked, finish = yield from self._loop(session, limit, greedy, request.temperature, request.seed,
                                               hold_while=repeat_of, cancelled=request.cancelled)
        sampled = ""
        if repeat_of is not None and picked == repeat_of and finish is not FinishReason.CANCELLED:
            # The fixed point: the same input on the same working set gave the same greedy answer.
            # Take that answer back out of attention and sample this turn instead (seeded, reported).
            self.mover.cut(session, segments_before)
            seed = self.fixed_point_seed + session.pager.turn
            first = pick_token(prompt_logits, False, 0.8, 0, 1.0, np.random.default_rng(seed))
            picked, finish = yield from self._loop(session, limit, False, 0.8, seed, first=first,
                                                   cancelled=request.cancelled)
            self.tally.count(session, fixed_point_resamples=1)
            sampled = f"fixed point: the greedy answer repeated the previous turn's; sampled with seed {seed}"
        session.last_answer = LastAnswer(session.pager.turn, prompt_ids, picked)
        return picked, finish, sampled

    def _loop(self, session: Session, limit: int, greedy: bool, temperature: float, seed: int | None,
              first: int | None = None, hold_while: list[int] | None = None,
              cancelled: Callable[[], bool] | None = None
              ) -> Generator[TurnEvent, int | None, tuple[list[int], FinishReason]]:
        """Pick tokens until a stop token or the limit. Every picked token but a stop is fed, so the
        cache spells exactly the answer. With `hold_while`, text is held back while the answer
        matches that earlier answer (it may be replaced by a sampled one)."""
        pager = session.pager
        picked: list[int] = []
        emitted = ""
        finish = FinishReason.LENGTH
        gone = cancelled or (lambda: False)
        token = self.mover.backend.decode(greedy=greedy, temperature=temperature, seed=seed) if first is None else first
        reseed = seed if first is not None else None  # a given first token was sampled outside: seed what follows
        while True:
            if token in self.stop_ids:
                finish = FinishReason.STOP
                break
            picked.append(token)
            holding = hold_while is not None and picked == hold_while[:len(picked)]
            text = self.format.decode(picked)
            if not holding and not text.endswith(INCOMPLETE_CHARACTER) and len(text) > len(emitted):
                yield TurnEvent(delta=text[len(emitted):])
                emitted = text
            self.mover.make_room(session, 1)
            step = DecodeStep(self.mover.backend, picked[-1], greedy=greedy, temperature=temperature, seed=reseed)
            sent = yield TurnEvent(decode=step)
            token = sent if sent is not None else self.mover.backend.decode(
                step.token, greedy=greedy, temperature=temperature, seed=reseed)
            crashpoints.reached("serving.decode.token")
            reseed = None
            pager.append([picked[-1]])
            self.tally.peak(session, self.mover.backend.attention_tokens)
            if len(picked) >= limit:
                break
            if gone():
                # The turn ends here as if the limit were reached: the cache holds exactly what was
                # picked, and the turn is written through like any other.
                finish = FinishReason.CANCELLED
                self.tally.count(session, cancelled_turns=1)
                break
        text = self.format.decode(picked)
        if len(text) > len(emitted) and not (hold_while is not None and picked == hold_while):
            yield TurnEvent(delta=text[len(emitted):])
        session.transcript.append(Segment(text, list(picked), generated=True))
        return picked, finish
