"""The repository family: facts inside the files of a code base, among text that recurs file to file.

  boilerplate  `read` results that are near-identical boilerplate (the same handler code and the
               same prose paragraphs in every file, only the service name changes); each fact is
               one short sentence in one file, in one of five languages; the question is English
               and names the setting, not the value.
  code         Python modules; a constant, a default argument, a function or an exception raised
               with a message, defined in a file read long ago, asked about later by name or by
               behaviour (error messages in five languages).
  config       a YAML config per service with the same keys, beside a worker that reads those
               keys by name; the question names one key of one service's config.
  logs         CI logs of one test suite run again and again; the question asks what a test got
               in the one run where it failed.

Much of every file recurs in the others (the handler and its paragraphs, the config keys and the
workers that name them, the suite's list of tests, the helper functions), so a question's words
match many files that do not hold its answer: what these shapes put to a selector.

Dependency rules: the standard library, harness.shapes.session and harness.shapes.building;
never the registry (harness.shapes), which imports this module.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from harness.shapes.building import WORDS, Builder, fact_value, schedule_facts, unique_number
from harness.shapes.session import DEFAULT_TOKENS, LANGUAGES, OBJECTIVE, Question, Workload, approx_tokens

# -------------------------------------------------------------------------------------- boilerplate

_AREAS = ("orders", "billing", "search", "export", "auth", "media", "reports", "inventory", "shipping", "profiles")
_KNOBS = ("max_batch", "retry_limit", "timeout_ms", "page_size", "queue_depth", "cache_ttl", "pool_size",
          "rate_limit")

_HANDLER = '''"""HTTP handler for the {svc} service."""
import logging

from app.http import Request, Response, json_response
from app.auth import require_scope
from app.settings import settings

log = logging.getLogger(__name__)


@require_scope("{svc}:read")
def handle_{svc}(request: Request) -> Response:
    payload = request.json()
    if not payload:
        return json_response({{"error": "empty payload"}}, status=400)
    batch = settings.get("{svc}.max_batch", 100)
    retries = settings.get("{svc}.retry_limit", 3)
    items = payload.get("items", [])[:batch]
    for attempt in range(retries):
        try:
            result = process_items(items, timeout=settings.get("{svc}.timeout_ms", 2000))
            break
        except TransientError:
            log.warning("attempt %d of %d failed", attempt + 1, retries)
    else:
        return json_response({{"error": "upstream unavailable"}}, status=503)
    return json_response({{"items": result, "page_size": settings.get("{svc}.page_size", 50)}})
'''

_PARAGRAPH = ("This service is part of the platform monorepo. It follows the standard layout: the HTTP handler "
              "lives in handler.py, settings are read through app.settings with per-service keys, and every "
              "request is authorised by scope before any work is done. Transient upstream errors are retried a "
              "bounded number of times; anything else is returned to the caller as a JSON error. Do not add "
              "service-specific behaviour to the shared helpers; open a ticket with the platform team instead.")
_PARAGRAPH_2 = ("Operational notes: dashboards and alerts are generated from the service catalogue, so keep the "
                "catalogue entry up to date. Settings changes are rolled out by the configuration pipeline within "
                "fifteen minutes and need no deployment. Capacity reviews happen monthly.")

_SETTING_FACTS = {
    "en": "The setting {key} is {v} in production.",
    "es": "En producción, el ajuste {key} vale {v}.",
    "ja": "本番環境では設定 {key} は {v} です。",
    "ar": "في بيئة الإنتاج قيمة الإعداد {key} هي {v}.",
    "ru": "В продакшене настройка {key} равна {v}.",
}


def boilerplate(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"boilerplate:{seed}")
    b = Builder(tokens, rng)
    used: set[str] = set()
    keys = rng.sample([f"{a}.{k}" for a in _AREAS for k in _KNOBS], facts)
    schedule = schedule_facts(b, facts, 480)
    n = 0
    while not b.full():
        svc = _AREAS[(n // 2) % len(_AREAS)]
        planted: list[tuple[str, str]] = []
        for i in schedule[n] if n < len(schedule) else []:
            language = LANGUAGES[(i + seed) % len(LANGUAGES)]
            value = unique_number(rng, used, 1100, 9900)
            fact = _SETTING_FACTS[language].format(key=keys[i], v=value)
            planted.append((fact, language))
            b.questions.append(Question(f"What is the production value of the setting {keys[i]}?", value,
                                        (fact,), (value,), language, "setting"))
        if n % 2 == 0:
            body = [f"# {_PARAGRAPH}", *_HANDLER.format(svc=svc).splitlines(), "", f"# {_PARAGRAPH_2}"]
            for fact, _ in planted:
                at = rng.choice([i for i, line in enumerate(body) if line.startswith("    ")])
                body.insert(at, f"    # {fact}")
            path = f"services/{svc}/handler.py"
        else:
            body = [f"# {svc}", "", _PARAGRAPH, "", "## Settings", "",
                    *[f"- `{svc}.{k}`: see the catalogue" for k in _KNOBS], "", _PARAGRAPH_2, "",
                    "```python", *_HANDLER.format(svc=svc).splitlines()[10:18], "```"]
            for fact, _ in planted:
                body.insert(rng.randint(3, len(body) - 10), fact)
            path = f"services/{svc}/README.md"
        b.add(path, "\n".join(body), planted[0][1] if planted else "code" if n % 2 == 0 else "en")
        n += 1
    return Workload("boilerplate", seed, tuple(b.files), tuple(b.questions),
                    objective=OBJECTIVE + " The services share one layout; look for what differs.")


# --------------------------------------------------------------------------------------------- code

_VERBS = ("load", "save", "parse", "render", "merge", "split", "validate", "encode", "fetch", "flush", "resolve",
          "rotate", "compact", "archive", "schedule")
_NOUNS = ("invoice", "ledger", "session", "bundle", "manifest", "token", "report", "snapshot", "cursor", "tenant",
          "payload", "receipt", "quota", "batch", "profile")
_TYPES = ("str", "int", "bytes", "dict[str, Any]", "list[str]", "Path")

_FUNCTION = '''def {verb}_{noun}(self, {arg}: {typ}) -> {ret}:
    """{Verb} the {noun} and return the result."""
    if not {arg}:
        raise ValueError("{noun} must not be empty")
    with self._lock:
        cached = self._{noun}_cache.get({arg})
        if cached is not None:
            return cached
    result = self._backend.{verb}({arg})
    self._{noun}_cache[{arg}] = result
    log.debug("{verb} {noun} took %.1f ms", self._clock.elapsed())
    return result
'''

_ERROR_MESSAGES = {
    "en": "the {noun} quota of {v} per day was reached",
    "es": "se alcanzó la cuota diaria de {v} para {noun}",
    "ja": "{noun} の1日あたりの上限 {v} に達しました",
    "ar": "تم الوصول إلى الحد اليومي {v} من {noun}",
    "ru": "достигнут дневной лимит {v} для {noun}",
}

_BEHAVIOURS: list[tuple[str, str, str]] = [
    # (definition with {fn} and {v}, question with {v}, kind)
    ('def {fn}(tenant_id: str) -> int:\n    """Shard of a tenant."""\n'
     '    return zlib.crc32(tenant_id.encode()) % {v}\n',
     "Which function maps a tenant id to a shard with crc32 modulo {v}? Give its name.", "behaviour"),
    ('def {fn}(name: str) -> str:\n    """Object key of an upload."""\n    return "uploads/{v}/" + name.lower()\n',
     "Which function builds the object key of an upload under uploads/{v}/? Give its name.", "behaviour"),
    ('def {fn}(attempt: int) -> float:\n    """Backoff before a retry."""\n    return min({v}, 0.5 * 2 ** attempt)\n',
     "Which function computes the retry backoff capped at {v} seconds? Give its name.", "behaviour"),
]


def _class_name(rng: random.Random) -> str:
    return f"{rng.choice(_NOUNS).capitalize()}{rng.choice(('Exceeded', 'Rejected', 'Expired', 'Missing'))}Error"


def _code_fact(kind: str, language: str, rng: random.Random, used: set[str], fresh_fn: Callable[[], str]
               ) -> tuple[str, Question]:
    """A planted definition (the text that goes in the module) and its question; `language` is the
    language of an error message (the other kinds are code only)."""
    language = language if kind == "error" else "code"
    if kind == "constant":
        name = f"MAX_{rng.choice(_NOUNS).upper()}_{rng.choice(WORDS).upper()}"
        while name in used:
            name = f"MAX_{rng.choice(_NOUNS).upper()}_{rng.choice(WORDS).upper()}"
        used.add(name)
        value = unique_number(rng, used, 10000, 99999)
        snippet = f"{name} = {value}\n"
        return snippet, Question(f"What value is {name} set to?", value, (snippet.strip(),), (value,), language, kind)
    if kind == "default":
        fn = fresh_fn()
        value = f"{unique_number(rng, used, 100, 999)}.5"
        line = f"def {fn}(url: str, timeout: float = {value}) -> Any:"
        snippet = line + '\n    """Open a connection."""\n    return connect(url, timeout=timeout)\n'
        return snippet, Question(f"What default timeout does {fn} use?", value, (line,), (value,), language, kind)
    if kind == "behaviour":
        template, ask, _ = _BEHAVIOURS[rng.randrange(len(_BEHAVIOURS))]
        fn = fresh_fn()
        value = unique_number(rng, used, 100, 999)
        snippet = template.format(fn=fn, v=value)
        return snippet, Question(ask.format(v=value), fn, (snippet.rstrip("\n"),), (fn,), language, kind)
    cls = _class_name(rng)
    while cls in used:
        cls = _class_name(rng)
    used.add(cls)
    value = unique_number(rng, used, 100, 999)
    message = _ERROR_MESSAGES[language].format(noun=rng.choice(_NOUNS), v=value)
    fn = fresh_fn()
    raise_line = f'raise {cls}("{message}")'
    snippet = (f"def {fn}(self, count: int) -> None:\n    if count > self.limit:\n        {raise_line}\n"
               f"    self.count = count\n")
    return snippet, Question(f'Which exception class is raised with the message "{message}"?', cls, (raise_line,),
                             (cls,), language, kind)


def code(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"code:{seed}")
    b = Builder(tokens, rng)
    used: set[str] = set()
    kinds = ["constant", "default", "behaviour", "error"]
    plan = [kinds[i % len(kinds)] for i in range(facts)]
    rng.shuffle(plan)
    schedule = schedule_facts(b, facts, 1050)
    fn_names: set[str] = set()

    def fresh_fn() -> str:
        while True:
            fn = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{rng.choice(WORDS)}"
            if fn not in fn_names:
                fn_names.add(fn)
                return fn

    n = 0
    while not b.full():
        module = f"{rng.choice(_NOUNS)}_{rng.choice(('store', 'service', 'client', 'jobs', 'utils'))}"
        parts: list[str] = [f'"""{module.replace("_", " ").capitalize()}: helpers used by the workers."""',
                            "from __future__ import annotations\n\nimport logging\nimport zlib\n"
                            "from pathlib import Path\nfrom typing import Any\n\n"
                            "from app.errors import *  # noqa: F403\n\nlog = logging.getLogger(__name__)\n"]
        target = rng.randint(800, 1300)
        while approx_tokens("\n".join(parts)) < target:
            verb, noun = rng.choice(_VERBS), rng.choice(_NOUNS)
            parts.append(_FUNCTION.format(verb=verb, Verb=verb.capitalize(), noun=noun, arg=f"{noun}_id",
                                          typ=rng.choice(_TYPES), ret=rng.choice(_TYPES)))
            if rng.random() < 0.3:
                parts.append(f"DEFAULT_{noun.upper()}_LIMIT = {rng.randint(2, 90)}\n")
        for i in schedule[n] if n < len(schedule) else []:
            snippet, question = _code_fact(plan[i], LANGUAGES[(i + seed) % len(LANGUAGES)], rng, used, fresh_fn)
            parts.insert(rng.randint(2, len(parts)), snippet)
            b.questions.append(question)
        b.add(f"src/{module}_{n:02d}.py", "\n".join(parts), "code")
        n += 1
    return Workload("code", seed, tuple(b.files), tuple(b.questions))


# ------------------------------------------------------------------------------------------- config

_PEOPLE = ("dana", "lior", "mika", "ravi", "sofia", "tomas", "yuki", "amir", "irina", "pablo", "noor", "kenji")
_CONFIG_KEYS: dict[str, tuple[str, str]] = {
    # key: (how a question names it, the kind of value)
    "listen_port": ("the listen port", "port"),
    "request_timeout_ms": ("the request timeout", "timeout"),
    "dead_letter_queue": ("the dead-letter queue", "queue"),
    "archive_bucket": ("the archive bucket", "bucket"),
}
_CONFIG_COMMON = ("replicas: {a}\nlog_level: info\nmax_retries: {b}\npool_size: {c}\nmetrics: true\n"
                  "tracing:\n  enabled: true\n  sample_rate: 0.{d}\n")

_WORKER = '''"""Worker for the {svc} service: reads config/{svc}.yaml at start."""
from __future__ import annotations

import logging

from app.config import load_config
from app.queue import Consumer

log = logging.getLogger(__name__)
cfg = load_config("config/{svc}.yaml")


def run() -> None:
    consumer = Consumer(cfg["dead_letter_queue"], pool_size=cfg["pool_size"])
    timeout = cfg["request_timeout_ms"] / 1000
    port = cfg["listen_port"]
    bucket = cfg["archive_bucket"]
    for attempt in range(cfg["max_retries"]):
        try:
            consumer.serve(port=port, timeout=timeout, archive=bucket)
            return
        except ConnectionError:
            log.warning("{svc} worker: attempt %d of %d failed", attempt + 1, cfg["max_retries"])
'''


def _config_value(kind: str, svc: str, rng: random.Random, used: set[str]) -> str:
    if kind in ("port", "timeout"):
        return fact_value(kind, rng, used)
    while True:
        tag = f"{rng.randrange(16 ** 4):04x}"
        value = f"{svc}-dlq-{tag}" if kind == "queue" else f"s3://{svc}-archive-{tag}"
        if value not in used:
            used.add(value)
            return value


def config(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    """Every service has a YAML config with the same keys and a worker that reads those keys by
    name and names its config file; a question names one key of one service's config. The worker
    code and the tool calls that read such files share the key and the service with the question,
    the config file itself holds the value: the miss issue 24 examined, made a shape."""
    rng = random.Random(f"config:{seed}")
    b = Builder(tokens, rng)
    used: set[str] = set()
    services = [f"{a}-{c}" for a in _AREAS for c in ("api", "worker", "sync", "cron", "gateway")]
    rng.shuffle(services)
    schedule = schedule_facts(b, facts, 700)  # a config and its worker
    n = 0
    while not b.full():
        pair = n // 2
        svc = services[pair % len(services)]
        if n % 2 == 1:
            b.add(f"workers/{svc.replace('-', '_')}.py", _WORKER.format(svc=svc), "code")
            n += 1
            continue
        values = {key: _config_value(kind, svc, rng, used) for key, (_, kind) in _CONFIG_KEYS.items()}
        lines = [f"# config/{svc}.yaml: deployed by the config pipeline; do not edit by hand.",
                 f"# Owner: {rng.choice(_PEOPLE)}. Reviewed {rng.randint(1, 28)} days ago.",
                 f"service: {svc}", *(f"{key}: {value}" for key, value in values.items()),
                 _CONFIG_COMMON.format(a=rng.randint(2, 9), b=rng.randint(2, 9), c=rng.randint(4, 64),
                                       d=rng.randint(1, 9)).rstrip("\n"),
                 *(f"feature_{rng.choice(WORDS)}_{k}: {rng.choice(('true', 'false'))}" for k in range(6))]
        asked = schedule[pair] if pair < len(schedule) else []
        for key in rng.sample(sorted(_CONFIG_KEYS), min(len(asked), len(_CONFIG_KEYS))):
            b.questions.append(Question(f"In config/{svc}.yaml, what is {_CONFIG_KEYS[key][0]} ({key})?",
                                        values[key], (f"{key}: {values[key]}",), (values[key],), "en", key))
        b.add(f"config/{svc}.yaml", "\n".join(lines), "en")
        n += 1
    return Workload("config", seed, tuple(b.files), tuple(b.questions),
                    objective=OBJECTIVE + " Configs and workers share their key names; mind which file is which.")


# --------------------------------------------------------------------------------------------- logs

_TESTS = [f"test_{verb}_{noun}" for verb in ("load", "save", "parse", "merge", "refund", "rotate", "export")
          for noun in ("invoice", "ledger", "session", "receipt", "quota", "cursor", "tenant", "bundle")]


def logs(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    """CI logs of the same test suite run again and again: every run lists every test, and a test
    that failed once is PASSED in every other run. The question asks what a test got when it
    failed: the run where it failed holds the answer, and every run names the test."""
    rng = random.Random(f"logs:{seed}")
    b = Builder(tokens, rng)
    used: set[str] = set()
    suite = rng.sample(_TESTS, 40)
    failing = rng.sample(suite, facts)
    schedule = schedule_facts(b, facts, 900)
    n = 0
    while not b.full():
        failed: dict[str, tuple[str, str]] = {}
        for i in schedule[n] if n < len(schedule) else []:
            expected, got = unique_number(rng, used, 1100, 9900), unique_number(rng, used, 1100, 9900)
            failed[failing[i]] = (expected, got)
        lines = ["============================= test session starts ==============================",
                 f"platform linux -- Python 3.11.{rng.randint(2, 9)}, pytest-8.{rng.randint(0, 3)}.{rng.randint(0, 4)}",
                 f"collected {len(suite)} items", ""]
        order = list(suite)
        rng.shuffle(order)
        for k, test in enumerate(order):
            module = test.split("_", 2)[2]
            status = "FAILED" if test in failed else "PASSED"
            lines.append(f"tests/test_{module}.py::{test} {status} [{100 * (k + 1) // len(order):3d}%]")
        for test, (expected, got) in failed.items():
            module = test.split("_", 2)[2]
            lines += ["", f"___________________________ {test} ___________________________", "",
                      f"    def {test}():", f"        result = run_{test.removeprefix('test_')}(fixture())",
                      f">       assert result.total == {expected}",
                      f"E       AssertionError: expected total {expected}, got {got}",
                      "", f"tests/test_{module}.py:{rng.randint(20, 300)}: AssertionError"]
            evidence = f"E       AssertionError: expected total {expected}, got {got}"
            b.questions.append(Question(f"When {test} failed in CI, what total did it get?", got, (evidence,),
                                        (got,), "en", "failure"))
        summary = f"{len(failed)} failed, {len(suite) - len(failed)} passed" if failed else f"{len(suite)} passed"
        lines += ["", f"======================== {summary} in {rng.randint(20, 90)}.{rng.randint(10, 99)}s "
                  "========================"]
        b.add(f"ci/run-{n:02d}.log", "\n".join(lines), "en")
        n += 1
    return Workload("logs", seed, tuple(b.files), tuple(b.questions),
                    objective=OBJECTIVE + " The CI logs are runs of the same suite; note what failed and how.")

