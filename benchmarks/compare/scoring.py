"""The comparison's answers by likelihood: every question of a session scored over the view its
answer was read from (the server's own readings, or llama.cpp's rendered prompt prefilled afresh),
and --diagnose's replay of each kv-elision view through a fresh prefill.

Depends on backends (the replay), benchmarks.answers, harness.fact_script and the arms.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import answers
from benchmarks.compare.arms import ARM_ROLES
from benchmarks.compare.play import ArmResult, Turn
from harness.fact_script import Script, answer_candidates, answers_with, fact_needle
from serving.paging import rewind


def score_result(result: ArmResult, script: Script, scorers: dict[str, answers.ViewScorer], max_new: int
                 ) -> list[answers.Scored]:
    """Every question of one arm's session by likelihood: a kv-elision arm from the server's own
    readings (and, for the shipped default, the four reference views derived from them); a
    llama.cpp arm from the prompt it rendered, prefilled afresh. One scorer for all: `scorers`
    holds one per kind of view ("" for the first), all on the same weights."""
    scorer = scorers[""]

    def scorer_for(kind: str) -> answers.ViewScorer:
        if kind not in scorers:
            scorers[kind] = scorer.sibling()
        return scorers[kind]

    values = [f.code for f in script.facts]
    role = ARM_ROLES.get(result.arm, "other")
    out: list[answers.Scored] = []

    def candidates(turn: Turn) -> list[list[int]]:
        return [scorer.format.encode(text) for text in answer_candidates(script.facts, turn.fact or "")]

    def scored(arm: str, kind: str, turn: Turn, logprobs: list[float], correct: bool, tokens: int) -> None:
        assert turn.fact is not None
        right = values.index(turn.fact)
        out.append(answers.Scored(arm, kind, result.seed, result.session, turn.step, turn.fact, logprobs[right],
                                  answers.rank_of(logprobs, right), len(values), correct, tokens))

    for turn in result.questions():
        assert turn.fact is not None
        reading = result.readings.get(turn.step)
        if reading is not None:
            scored(result.arm, role, turn, reading["logprobs"], bool(turn.correct), len(reading["view_ids"]))
            for name, branch in reading["branches"].items():
                # A branch answers one token: its greedy answer is not read, only its likelihoods.
                scored(branch_arm(result.arm, name), "branch", turn, branch["logprobs"], False,
                       len(branch["view_ids"]))
            if role != "default":
                continue
            span = answers.find_span(reading["transcript_ids"], fact_needle(turn.fact), scorer.format.decode)
            for kind, ids in answers.reference_views(reading, span).items():
                view = scorer_for(kind)
                logprobs = view.score(ids, candidates(turn))
                scored(f"reference / {kind}", kind, turn, logprobs,
                       answers_with(view.greedy(ids, max_new), turn.fact), len(ids))
        elif turn.step in result.prompts:
            ids = scorer.format.encode(result.prompts[turn.step])
            view = scorer_for(result.arm)
            scored(result.arm, role, turn, view.score(ids, candidates(turn)), bool(turn.correct), len(ids))
    return out


def branch_arm(arm: str, selector: str) -> str:
    """The name under which a kv-elision arm's questions answered in branches by `selector` are scored."""
    return f"{arm} / branch: {selector}"


def score_and_tell(result: ArmResult, script: Script, model: str, capacity: int,
                   scorers: dict[str, answers.ViewScorer], max_new: int) -> list[answers.Scored]:
    started = time.perf_counter()
    if "" not in scorers:
        scorers[""] = answers.ViewScorer(model, capacity=capacity)
    mine = score_result(result, script, scorers, max_new)
    for arm_name in dict.fromkeys(x.arm for x in mine):
        got = [x for x in mine if x.arm == arm_name]
        print(f"   by likelihood, seed {result.seed} {result.session}, {arm_name}: right value ranked first "
              f"{sum(x.rank == 1 for x in got)}/{len(got)}, mean log-probability "
              f"{sum(x.logprob for x in got) / len(got):.2f}, greedy {sum(x.correct for x in got)}/{len(got)}",
              flush=True)
    print(f"   (seed {result.seed} {result.session} scored in {time.perf_counter() - started:.0f} s)", flush=True)
    return mine


def replay_views(results: list[ArmResult], tokenizer: Any, model: str, capacity: int, max_new: int = 24) -> str:
    """Item 4's check on the kv-elision arms: for every turn, the exact tokens the answer was
    decoded from (the resident pages after the turn, in timeline order, cut where the answer
    begins), prefilled afresh by the same torch backend at contiguous positions and decoded
    greedily. The served answer attended to K/V computed in the pages' original context, evicted,
    restored and re-anchored; the replay computes K/V from those tokens alone. Where the two
    disagree on turns that restored pages and agree on turns that did not, what restored pages
    hand the model is what differs; where both miss a fact, the view itself is what the model
    cannot read."""
    from backends import load_backend

    rows = ["| arm | turn | kind | fact | tokens in view | served answer | replayed answer (fresh prefill) "
            "| same start |",
            "|---|---|---|---|---|---|---|---|"]
    backend = load_backend("torch", model, capacity=capacity)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    agree: dict[str, list[int]] = {}
    for r in results:
        for turn in r.turns:
            ids = r.views.get(turn.step)
            if ids is None:
                continue
            rewind(backend, 0)
            backend.prefill(ids)
            out: list[int] = []
            for _ in range(max_new):
                token = backend.decode()
                if token in stop:
                    break
                out.append(token)
            replay = tokenizer.decode(out)
            same = clip(replay, 30) == clip(turn.answer, 30)
            tally = agree.setdefault(r.arm, [0, 0])
            tally[0] += same
            tally[1] += 1
            served = clip(turn.answer)
            if turn.fact is not None:
                ok = answers_with(replay, turn.fact)
                served = f"{'✔' if turn.correct else '✘'} {served}"
                replay = f"{'✔' if ok else '✘'} {replay}"
            rows.append(f"| {r.arm} (seed {r.seed}) | {turn.step} | {turn.kind} | {turn.fact or ''} | {len(ids)} | "
                        f"{served} | {clip(replay)} | {'yes' if same else 'no'} |")
    rows += [f"\n{arm}: served and replayed answers start alike (30 characters) on {a} of {n} turns"
             for arm, (a, n) in agree.items()]
    return "\n".join(rows)


def clip(text: str, n: int = 60) -> str:
    return text.strip().replace("\n", " ").replace("|", "/")[:n]
