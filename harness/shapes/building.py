"""What every generator builds with: the session under construction and values unique in it.

`Builder` collects the files in session order with a running size estimate; `schedule_facts`
spreads the facts over the files that end in the cold region, before the newest
`max(6000, tokens // 4)` tokens, so every fact is cold at a budget of 4,096 (and 2,048) whatever
the size. `unique_number` and `fact_value` never hand out a value twice in a session, so an
answer occurs in exactly one place (the registry's check holds every workload to that). Both
families of shapes use these; what only one family uses lives in its module.

Dependency rules: the standard library and harness.shapes.session; never the families or the
registry, which build on this module.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from harness.shapes.session import Question, SourceFile, approx_tokens

WORDS = ("north", "amber", "delta", "harbor", "quartz", "meadow", "cobalt", "summit", "willow", "copper", "lagoon",
         "ridge", "falcon", "cedar", "marble", "prism")


def _code(rng: random.Random, used: set[str]) -> str:
    """A four-digit code such as QUARTZ-4821, unique in the session."""
    while True:
        value = f"{rng.choice(WORDS).upper()}-{rng.randint(1000, 9999)}"
        if value not in used:
            used.add(value)
            return value


def unique_number(rng: random.Random, used: set[str], low: int, high: int) -> str:
    """A number in [low, high] whose digits appear nowhere else in the session's values."""
    while True:
        value = str(rng.randint(low, high))
        if value not in used:
            used.add(value)
            return value


@dataclass
class Builder:
    """Files in session order, with a running size estimate, and the questions so far."""

    tokens: int
    rng: random.Random
    files: list[SourceFile] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    size: int = 600  # opening and template overhead

    @property
    def cold_limit(self) -> int:
        """Facts go only in files that end before this many tokens."""
        return self.tokens - max(6000, self.tokens // 4)

    def add(self, path: str, text: str, language: str) -> None:
        self.files.append(SourceFile(path, text, language))
        self.size += approx_tokens(text) + 40 + approx_tokens(path) * 2

    def full(self) -> bool:
        return self.size >= self.tokens


def schedule_facts(b: Builder, facts: int, file_tokens: int) -> list[list[int]]:
    """Which facts go in which of the first files: spread evenly over the files that fit in the
    cold region (files of about `file_tokens`), several to a file when there are more facts."""
    slots = max(2, (b.cold_limit - b.size) // file_tokens)
    out: list[list[int]] = [[] for _ in range(slots)]
    for i in range(facts):
        out[(i * slots) // facts if facts >= slots else round(i * (slots - 1) / max(1, facts - 1))].append(i)
    return out


def fact_value(kind: str, rng: random.Random, used: set[str]) -> str:
    """A fresh value for a fact of `kind`: a passphrase code, a port, a timeout in milliseconds, or
    else a bucket URL; here because the `prose` shape and the config files draw their values alike."""
    if kind == "passphrase":
        return _code(rng, used)
    if kind == "port":
        return unique_number(rng, used, 20000, 65000)
    if kind == "timeout":
        return unique_number(rng, used, 1100, 9900)
    while True:
        value = f"s3://{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(16 ** 4):04x}"
        if value not in used:
            used.add(value)
            return value

