"""The scripted session of the Pi comparison and the demo: evidence files, one planted fact each,
then questions about the oldest facts.

Evidence files come from harness.workload (six languages, in rotation); each gets one planted
fact about a distinct setting ("The on-call pager code is 9011."), and a question names the
setting. Everything follows from the seed. Also here: whether an answer holds a fact's code, the
text whose tokens must be in view for a fact, and the candidate answers a fact is scored with.
Depends on harness.workload only.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

from harness.workload import EvidenceFile, evidence_files
from harness.workload import Fact as WorkloadFact

SYSTEM_PROMPT = ("You are a careful coding agent working in a repository. The user shows you evidence files one "
                 "by one: note what each states, remember it, and answer later questions about them exactly.")
OBJECTIVE = ("Objective: I will show you the evidence files under evidence/ one by one. Note what each states; "
             "at the end I will ask you about specific settings from them. Answer with the exact value.")

# One distinct setting per fact, so a question names exactly one of them.
SUBJECTS = (
    "staging database password", "license key of the build farm", "on-call pager code",
    "API token of the metrics gateway", "encryption key label for backups", "release signing key id",
    "VPN pre-shared key", "admin console PIN", "webhook secret of the billing service",
    "recovery code of the root account", "deploy token of the mobile app", "cache cluster password",
    "SMTP relay password", "registry pull token", "audit log bucket key", "feature flag service token",
    "search index admin key", "payment sandbox secret", "SSO client secret", "backup vault passphrase",
    "CI runner registration token", "DNS provider API key", "queue broker password", "status page token",
)


@dataclass(frozen=True)
class Fact:
    file_index: int
    path: str
    language: str
    subject: str
    code: str
    statement: str
    question: str


@dataclass(frozen=True)
class Step:
    kind: str            # "file" or "question"
    message: str         # what Pi is prompted with
    fact: Fact | None    # the fact a question asks about


@dataclass(frozen=True)
class Script:
    seed: int
    steps: tuple[Step, ...]
    facts: tuple[Fact, ...]      # every planted fact
    asked: tuple[Fact, ...]      # the ones questions ask about


def subjects_for(seed: int) -> list[str]:
    subjects = list(SUBJECTS)
    random.Random(seed * 7919 + 1).shuffle(subjects)
    return subjects


def plant_fact(file: EvidenceFile, index: int, seed: int) -> tuple[EvidenceFile, Fact]:
    """The file with its planted fact rewritten as an English sentence about a distinct setting
    ("The on-call pager code is 9011."; a comment line in code files); the code is the 4-digit
    part of the workload's (DELTA-9011): with the word kept, SmolLM2-135M copied the digits and
    dropped the word (7 of 12 right with the fact's file alone in view, 12 of 12 with the digits
    alone; seed 7, docs/proof.md). The question names the setting: "What is the on-call pager
    code? ..."."""
    planted = file.facts[0]
    subject = subjects_for(seed)[index % len(SUBJECTS)]
    code = planted.answer.rsplit("-", 1)[-1]
    sentence = f"The {subject} is {code}."
    statement = f"# {sentence}" if file.language == "code" else sentence
    question = f"What is the {subject}? Answer with the value only."
    fact = Fact(index, file.path, file.language, subject, code, statement, question)
    rewritten = dataclasses.replace(
        file, text=file.text.replace(planted.statement, statement),
        facts=(WorkloadFact(planted.file_index, file.language, statement, question, code),))
    return rewritten, fact


def make_script(seed: int, files: int, tokens_per_file: int, questions: int) -> Script:
    """Evidence files from benchmarks.workload (six languages, in rotation), each with one planted
    fact (`plant_fact`), fed as user messages after an objective; then questions about the facts
    of the first `questions` files, oldest first."""
    steps: list[Step] = [Step("objective", OBJECTIVE, None)]
    facts: list[Fact] = []
    for i, original in enumerate(evidence_files(files, tokens_per_file=tokens_per_file, seed=seed)):
        file, fact = plant_fact(original, i, seed)
        if any(f.code == fact.code for f in facts):   # every code names one fact
            raise ValueError(f"seed {seed}: code {fact.code} planted twice")
        facts.append(fact)
        steps.append(Step("file", f"Here is {file.path}:\n\n{file.text}\n\nNote what it states in one sentence.", fact))
    asked = facts[:questions]
    steps.extend(Step("question", fact.question, fact) for fact in asked)
    return Script(seed, tuple(steps), tuple(facts), tuple(asked))


def fact_needle(code: str) -> str:
    """The text whose tokens must be in view: the end of the planted sentence, code included."""
    return f" is {code}."


def answer_candidates(facts: tuple[Fact, ...] | list[Fact], code: str) -> list[str]:
    """The answer to the question about `code`, once with every value planted in the session, in
    the shape SmolLM2 answers in ("The payment sandbox secret is 3471."). The lead-in is the same
    for all, so the ranking is that of the value given it; scoring bare digits right after the
    answer's opener asked for a start the model almost never makes (log-probabilities of -10 to
    -18 in a first run) and measured that more than the value."""
    fact = next(f for f in facts if f.code == code)
    return [f"The {fact.subject} is {f.code}." for f in facts]


def answers_with(answer: str, code: str) -> bool:
    """The exact code, not as part of a longer number."""
    return re.search(rf"(?<![0-9]){re.escape(code)}(?![0-9])", answer) is not None
