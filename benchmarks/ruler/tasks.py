"""RULER's synthetic tasks, generated here from the paper's published task definitions.

Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(NVIDIA, 2024, arXiv 2404.06654, Apache-2.0): written from the paper's task descriptions,
templates and configurations, not from RULER's code.

  niah_single_1     one needle; key a word, value a 7-digit number; the noise haystack (passkey retrieval)
  niah_single_2     the same on a haystack of text (the paper: essays; here: our log haystack)
  niah_single_3     the same with a UUID as the value
  niah_multikey_1   the target needle among 3 distractor needles with other keys, on the log haystack
  niah_multikey_2   the haystack is made of distractor needles (line retrieval); word keys, numbers
  niah_multikey_3   the haystack is made of distractor needles; UUID keys and UUID values (KV retrieval)
  niah_multivalue   one key, 4 needles with 4 values: all asked for
  niah_multiquery   4 needles with 4 keys: all 4 keys asked for at once
  vt                variable tracking: one chain of 4 hops (`VAR A = 12345.`, `VAR B = VAR A.`, ...)
                    on the noise haystack; every variable that ends up holding the value is asked for
  cwe               common words extraction: a numbered list in which 10 words appear 30 times and
                    every other word 3 times; the 10 are asked for
  fwe               frequent words extraction: coded words drawn from a zeta distribution (alpha 2);
                    the 3 most frequent are asked for

QA (SQuAD, HotpotQA) is left out: it needs data sets this project does not ship. Essays are not
shipped either, so the paper's essay haystack is replaced by a repetitive service log of our own.

Word keys are pairs of words from Debian's word list (/usr/share/dict/words, package wamerican),
numbers have 7 digits and UUIDs are version-4 UUIDs, as the paper defines its values. Every
sample is a function of (seed, task, length, index) and the tokenizer its length is measured in:
`random.Random` seeded with a string is the same on every machine and run.

A sample is a list of units (filler and needles, in order) with the instruction before them, the
question after them, RULER's answer prefix, the expected values and the candidate values its
answer is scored against by likelihood: the expected ones first, then values planted in the
haystack as distractors (the other needles' values, the rarer words), then made-up values of the
same form, up to `CANDIDATES` (chance is 1 in 12 for a one-value answer).

Depends on nothing of ours.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

WORDS_PATH = Path("/usr/share/dict/words")
CANDIDATES = 12            # values scored per question (more where more are expected)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# The paper's task configurations (its appendix): needles, chains, word frequencies.
MULTIKEY_DISTRACTORS = 3
MULTI_VALUES = 4
MULTI_QUERIES = 4
VT_CHAINS = 1
VT_HOPS = 4
CWE_COMMON = 10
CWE_COMMON_FREQ = 30
CWE_RARE_FREQ = 3
FWE_ALPHA = 2.0
FWE_TOP = 3


class MissingWordList(RuntimeError):
    """Debian's word list is not installed."""


def word_list(path: Path = WORDS_PATH) -> tuple[str, ...]:
    """Lower-case ASCII words of 4 to 10 letters from the word list, sorted (the same list on every
    machine with the same package)."""
    if not path.exists():
        raise MissingWordList(f"{path} is missing: the RULER keys are words from Debian's word list; "
                              "install it with `apt-get install wamerican`")
    return tuple(sorted({w for w in path.read_text(errors="replace").split()
                         if w.isascii() and w.isalpha() and w.islower() and 4 <= len(w) <= 10}))


@dataclass(frozen=True)
class Needle:
    text: str           # the sentence as planted
    value: str          # the value it states
    target: bool        # its value is expected in the answer


@dataclass(frozen=True)
class Sample:
    task: str
    length: int                      # fitted to: its agent form and answer cap take at most this many tokens
    index: int
    instruction: str                 # before the text, in RULER's form
    agent_instruction: str           # the same for an agent that reads the text as files
    question: str                    # after the text
    answer_prefix: str               # RULER's, the lead-in of every scored candidate
    units: tuple[str, ...]           # the haystack with its needles, in order
    separator: str                   # between units
    needles: tuple[Needle, ...]
    expected: tuple[str, ...]
    candidates: tuple[str, ...]      # expected first
    metric: str                      # "all" or "part" (string-match recall, as the paper scores the task)
    max_tokens: int                  # the greedy answer's cap

    @property
    def context(self) -> str:
        return self.separator.join(self.units)

    def scored(self, value: str) -> str:
        """The candidate answer for `value`: RULER's answer prefix, then the value."""
        return f"{self.answer_prefix} {value}"


# ------------------------------------------------------------------------------------ values


def number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def a_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def word_key(rng: random.Random, words: tuple[str, ...]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}"


def variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def distinct(draw: Callable[[], str], count: int, taken: set[str]) -> list[str]:
    """`count` values from `draw`, none in `taken` (which they join)."""
    out: list[str] = []
    while len(out) < count:
        value = draw()
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


# ------------------------------------------------------------------------------------ haystacks

_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
_PATHS = ("/api/v1/orders", "/api/v1/users", "/api/v1/items", "/healthz", "/api/v1/carts", "/metrics")
_LOG_LINES = (
    "{ts} {level} http worker-{w} GET {path}/{id} status=200 took={ms}ms",
    "{ts} {level} http worker-{w} POST {path} status=201 took={ms}ms",
    "{ts} {level} cache shard-{s} miss key=item:{id} refill={ms}ms",
    "{ts} {level} db pool-{s} query orders.by_user rows={r} took={ms}ms",
    "{ts} {level} queue consumer-{w} job={id} attempt={a}/5 requeued",
    "{ts} {level} scheduler tick={id} pending={r} running={a}",
)


def log_line(rng: random.Random, n: int) -> str:
    """One line of a service's log: a handful of shapes with small numbers (never 7 digits, so a
    needle's value is the only such number on the page)."""
    seconds = 8 * 3600 + n * 2 + rng.randint(0, 1)
    ts = f"2024-05-14T{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"
    return rng.choice(_LOG_LINES).format(ts=ts, level=rng.choice(_LEVELS), w=rng.randint(1, 8),
                                         path=rng.choice(_PATHS), id=rng.randint(100, 9999), ms=rng.randint(1, 900),
                                         s=rng.randint(0, 15), r=rng.randint(0, 400), a=rng.randint(1, 5))


def filler(kind: str, rng: random.Random, count: int, make_needle: Callable[[], str]) -> list[str]:
    """`count` units of a haystack: the noise paragraph, log lines, or distractor needles."""
    if kind == "noise":
        return [NOISE] * count
    if kind == "log":
        return [log_line(rng, n) for n in range(count)]
    return [make_needle() for _ in range(count)]


def plant(units: list[str], needles: list[str], rng: random.Random) -> list[str]:
    """The needles placed between units at depths drawn uniformly, in the given order."""
    depths = sorted(rng.randint(0, len(units)) for _ in needles)
    out: list[str] = []
    at = 0
    for depth, needle in zip(depths, needles, strict=True):
        out.extend(units[at:depth])
        out.append(needle)
        at = depth
    out.extend(units[at:])
    return out


# ------------------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class Drawn:
    """What a task draws for one sample, before `Sample` puts a length and an index on it."""

    instruction: str
    agent_instruction: str
    question: str
    answer_prefix: str
    units: list[str]
    separator: str
    needles: list[Needle]
    expected: list[str]
    candidates: list[str]
    metric: str = "all"


@dataclass(frozen=True)
class Task:
    name: str
    max_tokens: int                  # the greedy answer's cap
    draw: Callable[[random.Random, tuple[str, ...], int], Drawn] = field(repr=False)


def _agent(instruction: str, text: str = "the following text") -> str:
    return instruction.replace(text, "the files you are about to read")


def _niah(haystack: str, key_kind: str, value_kind: str, distractors: int = 0, values: int = 1,
          queries: int = 1) -> Callable[[random.Random, tuple[str, ...], int], Drawn]:
    """A needle-in-a-haystack task as the paper configures it: needles `One of the special magic
    {numbers|uuids} for {key} is: {value}.`, `values` needles sharing the asked key, `queries`
    keys asked at once, `distractors` needles with keys nobody asks for (or a haystack made of
    them)."""
    kind = "number" if value_kind == "number" else "uuid"

    def draw(rng: random.Random, words: tuple[str, ...], count: int) -> Drawn:
        taken: set[str] = set()

        def key() -> str:
            return a_uuid(rng) if key_kind == "uuid" else word_key(rng, words)

        def value() -> str:
            return a_uuid(rng) if value_kind == "uuid" else number(rng)

        def needle(k: str, v: str) -> str:
            return f"One of the special magic {kind}s for {k} is: {v}."

        keys = distinct(key, queries + distractors, taken)
        asked = keys[:queries]
        planted: list[Needle] = []
        for k in keys:
            for v in distinct(value, values if k in asked else 1, taken):
                planted.append(Needle(needle(k, v), v, k in asked))
        made_up = distinct(value, CANDIDATES, taken)
        extra: list[Needle] = []

        def distractor() -> str:
            k, v = distinct(key, 1, taken)[0], distinct(value, 1, taken)[0]
            extra.append(Needle(needle(k, v), v, False))
            return extra[-1].text

        units = filler(haystack, rng, count, distractor)
        order = planted[:]
        rng.shuffle(order)
        units = plant(units, [n.text for n in order], rng)
        expected = [n.value for n in planted if n.target]
        wrong = [n.value for n in planted if not n.target] + [n.value for n in rng.sample(extra, min(
            len(extra), CANDIDATES))]
        candidates = expected + (wrong + made_up)[:max(CANDIDATES - len(expected), 0)]
        if values > 1 or queries > 1:
            what = f"{kind}s"
            instruction = (f"Some special magic {what} are hidden within the following text. Make sure to memorize "
                           f"it. I will quiz you about the {what} afterwards.")
            for_keys = asked[0] if queries == 1 else ", ".join(asked[:-1]) + f", and {asked[-1]}"
            question = f"What are all the special magic {what} for {for_keys} mentioned in the provided text?"
            prefix = f"The special magic {what} for {for_keys} mentioned in the provided text are"
        else:
            instruction = (f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
                           f"I will quiz you about the {kind} afterwards.")
            question = f"What is the special magic {kind} for {asked[0]} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {asked[0]} mentioned in the provided text is"
        return Drawn(instruction, _agent(instruction), question, prefix, units, "\n", order + extra, expected,
                     candidates)

    return draw


def _vt(rng: random.Random, words: tuple[str, ...], count: int) -> Drawn:
    """Variable tracking: `VT_CHAINS` chains of `VT_HOPS` hops, each `VAR X = VAR Y.` after the
    line it copies, on the noise haystack; every variable of the asked chain is expected."""
    taken: set[str] = set()
    chains: list[list[Needle]] = []
    values = distinct(lambda: str(rng.randint(10_000, 99_999)), VT_CHAINS, set())
    for c, value in enumerate(values):
        names = distinct(lambda: variable(rng), VT_HOPS + 1, taken)
        chain = [Needle(f"VAR {names[0]} = {value}.", names[0], c == 0)]
        chain += [Needle(f"VAR {b} = VAR {a}.", b, c == 0) for a, b in zip(names, names[1:], strict=False)]
        chains.append(chain)
    made_up = distinct(lambda: variable(rng), CANDIDATES, taken)
    units = [NOISE] * count
    for chain in chains:
        units = plant(units, [n.text for n in chain], rng)
    asked = chains[0]
    expected = [n.value for n in asked]
    wrong = [n.value for chain in chains[1:] for n in chain] + made_up
    value = values[0]
    return Drawn("Memorize and track the chain(s) of variable assignment hidden in the following text.",
                 "Memorize and track the chain(s) of variable assignment hidden in the files you are about to read.",
                 f"Question: Find all variables that are assigned the value {value} in the text above.",
                 f"Answer: According to the chain(s) of variable assignment in the text above, {len(expected)} "
                 f"variables are assigned the value {value}, they are:",
                 units, " ", [n for chain in chains for n in chain], expected,
                 expected + wrong[:max(CANDIDATES - len(expected), 0)])


def _apart(chosen: list[str]) -> bool:
    """No word is inside another (string-match recall would count one for the other)."""
    return not any(a != b and a in b for a in chosen for b in chosen)


def _cwe(rng: random.Random, words: tuple[str, ...], count: int) -> Drawn:
    """Common words extraction: `count` rare words (3 times each) and 10 common ones (30 times
    each), shuffled into a numbered list."""
    while True:
        common = rng.sample(words, CWE_COMMON)
        if _apart(common):
            break
    rare = [w for w in rng.sample(words, min(len(words), count + 2 * CWE_COMMON)) if w not in common][:count]
    listed = common * CWE_COMMON_FREQ + rare * CWE_RARE_FREQ
    rng.shuffle(listed)
    shown = [w for w in rare if _apart([*common, w])][:CWE_COMMON]
    return Drawn("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.",
                 "The files you are about to read hold a numbered list of words. In these words, some appear more "
                 "often than others. Memorize the ones that appear most often.",
                 f"Question: What are the {CWE_COMMON} most common words in the above list?",
                 f"Answer: The top {CWE_COMMON} words that appear most often in the list are:",
                 [f"{n}. {w}" for n, w in enumerate(listed, 1)], "\n", [], common, common + shown)


def coded_word(rng: random.Random) -> str:
    """Five random letters: words of one length are never inside one another."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))


def _fwe(rng: random.Random, words: tuple[str, ...], count: int) -> Drawn:
    """Frequent words extraction: `count` coded words drawn from a zeta distribution over a
    vocabulary of made-up words; the 3 most frequent (with a clear lead over the 4th) expected."""
    vocabulary = distinct(lambda: coded_word(rng), max(60, count // 20), set())
    weights = [1.0 / (rank + 1) ** FWE_ALPHA for rank in range(len(vocabulary))]
    while True:
        drawn = rng.choices(vocabulary, weights=weights, k=count)
        ranked = Counter(drawn).most_common()
        if len(ranked) > FWE_TOP and ranked[FWE_TOP - 1][1] > ranked[FWE_TOP][1]:
            break
    expected = [w for w, _ in ranked[:FWE_TOP]]
    return Drawn("Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words.",
                 "Read the coded text in the files you are about to read and track the frequency of each coded word. "
                 "Find the three most frequently appeared coded words.",
                 "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                 "frequently appeared words in the above coded text?",
                 "Answer: According to the coded text above, the three most frequently appeared words are:",
                 drawn, " .... ", [], expected, [w for w, _ in ranked[:CANDIDATES]])


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("niah_single_1", 32, _niah("noise", "word", "number")),
    Task("niah_single_2", 32, _niah("log", "word", "number")),
    Task("niah_single_3", 48, _niah("log", "word", "uuid")),
    Task("niah_multikey_1", 32, _niah("log", "word", "number", distractors=MULTIKEY_DISTRACTORS)),
    Task("niah_multikey_2", 32, _niah("needles", "word", "number")),
    Task("niah_multikey_3", 64, _niah("needles", "uuid", "uuid")),
    Task("niah_multivalue", 64, _niah("log", "word", "number", values=MULTI_VALUES)),
    Task("niah_multiquery", 64, _niah("log", "word", "number", queries=MULTI_QUERIES)),
    Task("vt", 48, _vt),
    Task("cwe", 80, _cwe),
    Task("fwe", 40, _fwe),
)}


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


def make_sample(task: str, length: int, index: int, seed: int, words: tuple[str, ...], count: int) -> Sample:
    """The sample with `count` filler units (every draw starts again from the sample's seed)."""
    spec = TASKS[task]
    d = spec.draw(sample_rng(seed, task, length, index), words, count)
    return Sample(task, length, index, d.instruction, d.agent_instruction, d.question, d.answer_prefix,
                  tuple(d.units), d.separator, tuple(d.needles), tuple(d.expected), tuple(d.candidates), d.metric,
                  spec.max_tokens)
