"""Agent sessions of several shapes, with planted ground truth, for studying retrieval (issue 17).

Each generator builds a coding agent's session: an opening (system prompt, tool schemas, objective),
then one turn per file (the assistant calls `read`, the tool answers with the file's text, the
user asks for a note), and finally questions about facts planted in files read long before. A
question carries its text, the expected answer (exact value or code, checkable by substring) and
the evidence: exact substrings of the session whose pages hold the text the answer needs (two
for `split`). Everything comes from `(shape, seed)` through `random.Random`: no data set is read.

  prose           facts stated in prose files, in five languages; each question is asked in its
                  fact's language and names the thing (like harness.workload).
  boilerplate     `read` results that are near-identical boilerplate (the same handler code and the
                  same prose paragraphs in every file, only the service name changes); each fact is
                  one short sentence in one file, in one of five languages; the question is English
                  and names the setting, not the value.
  code            Python modules; a constant, a default argument, a function or an exception
                  raised with a message, defined in a file read long ago, asked about later by name
                  or by behaviour (error messages in five languages).
  paraphrase      the question shares little with the fact but the name of the thing: "How long
                  does Heron keep its backups?" for "Snapshots of Heron are deleted after 4120
                  hours." Each name is also mentioned in unrelated sentences elsewhere.
  split           two attributes of one thing stated in two different files (host in one, port in
                  the other, often in two languages); both pages are needed.
  near_duplicate  dozens of facts of the same sentence that differ only in the service they name
                  and the value ("The connection timeout of orders-api is 4312 ms."), with names
                  that share parts (orders-api, orders-worker, payments-api); the selector must
                  prefer the one the question names.

Seeds: TUNING_SEEDS (1, 2, 3) are the ones signals and parameters may be tuned on; HELD_OUT_SEEDS
(101, 102, 103) are for reporting only and nobody tunes on them.

Sizes: `tokens` is the approximate session length (SmolLM2 tokenizer, +-15%). Facts sit only in the
files that end before the newest `max(6000, tokens // 4)` tokens, so every fact is cold at a budget
of 4,096 (and 2,048), whatever the size.

    python -m harness.shapes [--shape boilerplate] [--seed 1] [--tokens 16000]

prints the session as chat messages (JSON) and the questions.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.workload import TOOLS

SHAPES = ("prose", "boilerplate", "code", "paraphrase", "split", "near_duplicate", "config", "logs")
LANGUAGES = ("en", "es", "ja", "ar", "ru")
TUNING_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103)
DEFAULT_TOKENS = 16000

SYSTEM_PROMPT = ("You are a careful coding agent working in a repository. Read the files the user points you to, "
                 "remember what they state, and answer questions about them exactly.")
OBJECTIVE = ("Objective: read the files I point you to one by one and note what matters. At the end I will ask "
             "about specific settings, values and code from them; answer with the exact value.")


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Question:
    """A question about planted facts, with what answers it and where the answer lives."""

    text: str
    answer: str                      # the expected answer (exact value or code; substring-checkable)
    evidence: tuple[str, ...]        # exact substrings of the session whose pages hold what is needed
    answer_parts: tuple[str, ...]    # what must appear in a reply; answer_parts[i] is inside evidence[i]
    language: str                    # language of the fact (the first evidence's, for split)
    kind: str                        # what is asked: "passphrase", "constant", "behaviour", ...


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    language: str


@dataclass(frozen=True)
class Workload:
    shape: str
    seed: int
    files: tuple[SourceFile, ...]
    questions: tuple[Question, ...]
    objective: str = OBJECTIVE
    system: str = SYSTEM_PROMPT
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.objective}]

    def turns(self) -> list[list[dict[str, Any]]]:
        """The messages each turn adds: a `read` tool call, its result, a short request."""
        out: list[list[dict[str, Any]]] = []
        for n, file in enumerate(self.files):
            call: dict[str, Any] = {"id": f"call_{n:03d}", "type": "function",
                    "function": {"name": "read", "arguments": json.dumps({"path": file.path})}}
            out.append([{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": file.text},
                        {"role": "user", "content": f"Note what matters in {file.path} in one sentence."}])
        return out

    def messages(self) -> list[dict[str, Any]]:
        return [*self.opening(), *(m for turn in self.turns() for m in turn)]

    def question_message(self, question: Question) -> dict[str, Any]:
        return {"role": "user", "content": question.text}

    def text(self) -> str:
        """Every message's content and tool call, joined: what evidence strings are substrings of."""
        parts = [self.system, json.dumps(self.tools), self.objective]
        for m in self.messages()[2:]:
            parts.append(str(m.get("content") or ""))
            parts.extend(json.dumps(c) for c in m.get("tool_calls", []))
        return "\n".join(parts)


def approx_tokens(text: str) -> int:
    """SmolLM2 tokens, roughly: ~4 characters a token for Latin script, ~1.2 tokens a character
    for Cyrillic and Arabic, ~1.8 for Japanese."""
    n = 0.0
    for ch in text:
        o = ord(ch)
        if o < 0x250:
            n += 0.26
        elif 0x400 <= o < 0x530:
            n += 0.8
        elif 0x600 <= o < 0x700:
            n += 0.85
        elif o >= 0x3000:
            n += 1.8
        else:
            n += 1.0
    return int(n) + 1


# ------------------------------------------------------------------------------------ shared pools

_FIRST = ("ledger", "atlas", "orion", "ember", "quill", "nimbus", "harbor", "tundra", "cobalt", "falcon", "maple",
          "zephyr", "granite", "lumen", "vesper", "cinder", "alpine", "juniper", "onyx", "saffron")
_SECOND = ("sync", "gateway", "worker", "cache", "relay", "indexer", "scheduler", "vault", "bridge", "proxy")
_WORDS = ("north", "amber", "delta", "harbor", "quartz", "meadow", "cobalt", "summit", "willow", "copper", "lagoon",
          "ridge", "falcon", "cedar", "marble", "prism")
_PEOPLE = ("dana", "lior", "mika", "ravi", "sofia", "tomas", "yuki", "amir", "irina", "pablo", "noor", "kenji")

_FILLER: dict[str, list[str]] = {
    "en": ["The {w} team reviews this document every quarter and keeps it short.",
           "Requests from the {w} region are routed through the secondary gateway.",
           "Every export file is compressed and its checksum is written next to it.",
           "The nightly job deletes temporary uploads older than {n} hours.",
           "Audit logs are kept for {n} days and then moved to cold storage.",
           "A user with the {w} role may approve refunds up to {n} euros.",
           "Deployments happen on weekdays only, never after four in the afternoon.",
           "If a health check fails {n} times in a row, the instance is replaced.",
           "Configuration changes go through review like any other code change.",
           "The dashboard shows the error rate of the last {n} minutes by default.",
           "Old feature flags are removed once every client has updated.",
           "Retries use exponential backoff with a little random jitter.",
           "Incidents are written up within {n} days, blameless and with a timeline.",
           "Secrets are never stored in the repository; the vault holds them."],
    "es": ["El equipo {w} revisa este documento cada trimestre.",
           "Las solicitudes de la región {w} pasan por la pasarela secundaria.",
           "Cada archivo exportado se comprime y su suma de control se guarda al lado.",
           "Los registros de auditoría se conservan {n} días y luego se archivan.",
           "La tarea nocturna borra las subidas temporales de más de {n} horas.",
           "Los despliegues se hacen solo en días laborables.",
           "Si una comprobación de salud falla {n} veces seguidas, la instancia se sustituye.",
           "Los cambios de configuración pasan por revisión como cualquier otro cambio.",
           "Los reintentos usan espera exponencial con un poco de variación aleatoria.",
           "Los secretos nunca se guardan en el repositorio; los guarda la bóveda."],
    "ja": ["{w}チームはこの文書を四半期ごとに見直す。",
           "{w}地域からのリクエストは予備のゲートウェイを経由する。",
           "すべてのエクスポートファイルは圧縮され、チェックサムが横に書かれる。",
           "夜間ジョブは{n}時間より古い一時アップロードを削除する。",
           "監査ログは{n}日間保存され、その後コールドストレージに移される。",
           "デプロイは平日のみ行い、午後四時以降は行わない。",
           "ヘルスチェックが{n}回連続で失敗するとインスタンスは置き換えられる。",
           "設定の変更は他のコード変更と同じくレビューを通す。",
           "再試行には少しのランダムな揺らぎを加えた指数バックオフを使う。",
           "秘密情報はリポジトリに保存せず、金庫に保管する。"],
    "ar": ["يراجع فريق {w} هذه الوثيقة كل ربع سنة.",
           "تمر الطلبات القادمة من منطقة {w} عبر البوابة الثانوية.",
           "يتم ضغط كل ملف تصدير وتكتب قيمة التحقق بجانبه.",
           "تحذف المهمة الليلية الملفات المؤقتة الأقدم من {n} ساعة.",
           "تحفظ سجلات التدقيق لمدة {n} يوما ثم تنقل إلى التخزين البارد.",
           "تتم عمليات النشر في أيام العمل فقط.",
           "إذا فشل فحص الصحة {n} مرات متتالية يتم استبدال الخادم.",
           "تمر تغييرات الإعدادات بالمراجعة مثل أي تغيير آخر في الشيفرة.",
           "لا تحفظ الأسرار في المستودع أبدا بل في الخزنة."],
    "ru": ["Команда {w} пересматривает этот документ каждый квартал.",
           "Запросы из региона {w} идут через резервный шлюз.",
           "Каждый файл экспорта сжимается, а его контрольная сумма пишется рядом.",
           "Ночная задача удаляет временные загрузки старше {n} часов.",
           "Журналы аудита хранятся {n} дней, затем переносятся в холодное хранилище.",
           "Развертывания проводятся только в будние дни.",
           "Если проверка здоровья не проходит {n} раз подряд, экземпляр заменяется.",
           "Изменения конфигурации проходят ревью, как и любой другой код.",
           "Секреты никогда не хранятся в репозитории, их хранит хранилище секретов."],
}
_HEADERS = {"en": "Notes", "es": "Notas", "ja": "メモ", "ar": "ملاحظات", "ru": "Заметки"}


def _filler(rng: random.Random, language: str) -> str:
    return rng.choice(_FILLER[language]).format(n=rng.randint(2, 90), w=rng.choice(_WORDS))


def _code(rng: random.Random, used: set[str]) -> str:
    """A four-digit code such as QUARTZ-4821, unique in the session."""
    while True:
        value = f"{rng.choice(_WORDS).upper()}-{rng.randint(1000, 9999)}"
        if value not in used:
            used.add(value)
            return value


def _number(rng: random.Random, used: set[str], low: int, high: int) -> str:
    """A number in [low, high] whose digits appear nowhere else in the session's values."""
    while True:
        value = str(rng.randint(low, high))
        if value not in used:
            used.add(value)
            return value


def _names(rng: random.Random, count: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in _FIRST for b in _SECOND]
    return rng.sample(pairs, count)


@dataclass
class _Builder:
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


def _prose_lines(rng: random.Random, language: str, tokens: int) -> list[str]:
    lines: list[str] = []
    while sum(approx_tokens(line) for line in lines) < tokens:
        lines.append(_filler(rng, language))
    return lines


def _place(lines: list[str], facts: list[str], rng: random.Random) -> list[str]:
    """Insert facts at distinct random lines (not the first two)."""
    out = list(lines)
    for fact in facts:
        out.insert(rng.randint(2, max(2, len(out) - 1)), fact)
    return out


def _schedule(b: _Builder, facts: int, file_tokens: int) -> list[list[int]]:
    """Which facts go in which of the first files: spread evenly over the files that fit in the
    cold region (files of about `file_tokens`), several to a file when there are more facts."""
    slots = max(2, (b.cold_limit - b.size) // file_tokens)
    out: list[list[int]] = [[] for _ in range(slots)]
    for i in range(facts):
        out[(i * slots) // facts if facts >= slots else round(i * (slots - 1) / max(1, facts - 1))].append(i)
    return out


# -------------------------------------------------------------------------------------------- prose

_PROSE_FACTS: dict[str, dict[str, tuple[str, str]]] = {
    "passphrase": {
        "en": ("The deployment passphrase for {name} is {v}.", "What is the deployment passphrase for {name}?"),
        "es": ("La contraseña de despliegue de {name} es {v}.", "¿Cuál es la contraseña de despliegue de {name}?"),
        "ja": ("{name} のデプロイ用パスフレーズは {v} です。", "{name} のデプロイ用パスフレーズは何ですか？"),
        "ar": ("عبارة المرور لنشر {name} هي {v}.", "ما هي عبارة المرور لنشر {name}؟"),
        "ru": ("Пароль развертывания для {name} — {v}.", "Какой пароль развертывания для {name}?")},
    "port": {
        "en": ("The {name} service listens on port {v}.", "Which port does the {name} service listen on?"),
        "es": ("El servicio {name} escucha en el puerto {v}.", "¿En qué puerto escucha el servicio {name}?"),
        "ja": ("{name} サービスはポート {v} で待ち受ける。", "{name} サービスはどのポートで待ち受けますか？"),
        "ar": ("تستمع خدمة {name} على المنفذ {v}.", "على أي منفذ تستمع خدمة {name}؟"),
        "ru": ("Сервис {name} слушает порт {v}.", "Какой порт слушает сервис {name}?")},
    "timeout": {
        "en": ("The request timeout of {name} is {v} milliseconds.", "What is the request timeout of {name}?"),
        "es": ("El tiempo de espera de {name} es de {v} milisegundos.", "¿Cuál es el tiempo de espera de {name}?"),
        "ja": ("{name} のリクエストタイムアウトは {v} ミリ秒です。",
               "{name} のリクエストタイムアウトは何ミリ秒ですか？"),
        "ar": ("مهلة الطلب في {name} هي {v} ملي ثانية.", "ما هي مهلة الطلب في {name}؟"),
        "ru": ("Тайм-аут запроса у {name} — {v} миллисекунд.", "Какой тайм-аут запроса у {name}?")},
    "bucket": {
        "en": ("Backups of {name} are written to the bucket {v}.", "Which bucket are backups of {name} written to?"),
        "es": ("Las copias de {name} se escriben en el bucket {v}.",
               "¿En qué bucket se escriben las copias de {name}?"),
        "ja": ("{name} のバックアップはバケット {v} に書き込まれる。",
               "{name} のバックアップはどのバケットに書き込まれますか？"),
        "ar": ("تكتب النسخ الاحتياطية من {name} في الحاوية {v}.", "في أي حاوية تكتب النسخ الاحتياطية من {name}؟"),
        "ru": ("Резервные копии {name} пишутся в бакет {v}.", "В какой бакет пишутся резервные копии {name}?")},
}


def _prose_value(kind: str, rng: random.Random, used: set[str]) -> str:
    if kind == "passphrase":
        return _code(rng, used)
    if kind == "port":
        return _number(rng, used, 20000, 65000)
    if kind == "timeout":
        return _number(rng, used, 1100, 9900)
    while True:
        value = f"s3://{rng.choice(_WORDS)}-{rng.choice(_WORDS)}-{rng.randrange(16 ** 4):04x}"
        if value not in used:
            used.add(value)
            return value


def prose(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"prose:{seed}")
    b = _Builder(tokens, rng)
    used: set[str] = set()
    names = _names(rng, facts)
    schedule = _schedule(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1200))
        planted: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            kind = rng.choice(sorted(_PROSE_FACTS))
            statement, question = _PROSE_FACTS[kind][language]
            value = _prose_value(kind, rng, used)
            fact = statement.format(name=names[i], v=value)
            planted.append(fact)
            b.questions.append(Question(question.format(name=names[i]), value, (fact,), (value,), language, kind))
        lines = [f"# docs/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"docs/{n:02d}-{rng.choice(_WORDS)}.md", "\n".join(lines), language)
        n += 1
    return Workload("prose", seed, tuple(b.files), tuple(b.questions))


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
    b = _Builder(tokens, rng)
    used: set[str] = set()
    keys = rng.sample([f"{a}.{k}" for a in _AREAS for k in _KNOBS], facts)
    schedule = _schedule(b, facts, 480)
    n = 0
    while not b.full():
        svc = _AREAS[(n // 2) % len(_AREAS)]
        planted: list[tuple[str, str]] = []
        for i in schedule[n] if n < len(schedule) else []:
            language = LANGUAGES[(i + seed) % len(LANGUAGES)]
            value = _number(rng, used, 1100, 9900)
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
        name = f"MAX_{rng.choice(_NOUNS).upper()}_{rng.choice(_WORDS).upper()}"
        while name in used:
            name = f"MAX_{rng.choice(_NOUNS).upper()}_{rng.choice(_WORDS).upper()}"
        used.add(name)
        value = _number(rng, used, 10000, 99999)
        snippet = f"{name} = {value}\n"
        return snippet, Question(f"What value is {name} set to?", value, (snippet.strip(),), (value,), language, kind)
    if kind == "default":
        fn = fresh_fn()
        value = f"{_number(rng, used, 100, 999)}.5"
        line = f"def {fn}(url: str, timeout: float = {value}) -> Any:"
        snippet = line + '\n    """Open a connection."""\n    return connect(url, timeout=timeout)\n'
        return snippet, Question(f"What default timeout does {fn} use?", value, (line,), (value,), language, kind)
    if kind == "behaviour":
        template, ask, _ = _BEHAVIOURS[rng.randrange(len(_BEHAVIOURS))]
        fn = fresh_fn()
        value = _number(rng, used, 100, 999)
        snippet = template.format(fn=fn, v=value)
        return snippet, Question(ask.format(v=value), fn, (snippet.rstrip("\n"),), (fn,), language, kind)
    cls = _class_name(rng)
    while cls in used:
        cls = _class_name(rng)
    used.add(cls)
    value = _number(rng, used, 100, 999)
    message = _ERROR_MESSAGES[language].format(noun=rng.choice(_NOUNS), v=value)
    fn = fresh_fn()
    raise_line = f'raise {cls}("{message}")'
    snippet = (f"def {fn}(self, count: int) -> None:\n    if count > self.limit:\n        {raise_line}\n"
               f"    self.count = count\n")
    return snippet, Question(f'Which exception class is raised with the message "{message}"?', cls, (raise_line,),
                             (cls,), language, kind)


def code(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"code:{seed}")
    b = _Builder(tokens, rng)
    used: set[str] = set()
    kinds = ["constant", "default", "behaviour", "error"]
    plan = [kinds[i % len(kinds)] for i in range(facts)]
    rng.shuffle(plan)
    schedule = _schedule(b, facts, 1050)
    fn_names: set[str] = set()

    def fresh_fn() -> str:
        while True:
            fn = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{rng.choice(_WORDS)}"
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


# --------------------------------------------------------------------------------------- paraphrase

_ENTITIES = ("Larkspur", "Heron", "Kestrel", "Marlin", "Juniper", "Osprey", "Tamarack", "Bramble", "Sorrel", "Wren",
             "Alder", "Cypress", "Plover", "Thistle", "Caraway", "Sable")

_PARAPHRASES: list[tuple[dict[str, str], str, str]] = [
    ({"en": "Snapshots of {e} are deleted after {v} hours.",
      "es": "Las instantáneas de {e} se borran a las {v} horas.",
      "ja": "{e} のスナップショットは {v} 時間後に削除される。",
      "ar": "تحذف لقطات {e} بعد {v} ساعة.",
      "ru": "Снимки {e} удаляются через {v} часов."},
     "For how long does {e} keep its backups before they are removed?", "retention"),
    ({"en": "{e} refuses uploads larger than {v} kilobytes.",
      "es": "{e} rechaza las subidas de más de {v} kilobytes.",
      "ja": "{e} は {v} キロバイトを超えるアップロードを拒否する。",
      "ar": "يرفض {e} الملفات المرفوعة الأكبر من {v} كيلوبايت.",
      "ru": "{e} отклоняет загрузки больше {v} килобайт."},
     "What is the biggest file {e} will accept?", "size"),
    ({"en": "No more than {v} people may edit {e} at once.",
      "es": "Como mucho {v} personas pueden editar {e} a la vez.",
      "ja": "{e} を同時に編集できるのは {v} 人までである。",
      "ar": "لا يمكن لأكثر من {v} شخص تعديل {e} في الوقت نفسه.",
      "ru": "Одновременно редактировать {e} могут не более {v} человек."},
     "How many users can change {e} concurrently?", "concurrency"),
    ({"en": "{e} wakes up every {v} seconds to look for new work.",
      "es": "{e} se despierta cada {v} segundos para buscar trabajo nuevo.",
      "ja": "{e} は {v} 秒ごとに起きて新しい仕事を探す。",
      "ar": "يستيقظ {e} كل {v} ثانية للبحث عن عمل جديد.",
      "ru": "{e} просыпается каждые {v} секунд, чтобы искать новую работу."},
     "How often does {e} poll for jobs?", "interval"),
    ({"en": "When {e} goes down, the phone at extension {v} rings.",
      "es": "Cuando {e} se cae, suena el teléfono de la extensión {v}.",
      "ja": "{e} が停止すると内線 {v} の電話が鳴る。",
      "ar": "عندما يتوقف {e} يرن الهاتف على التحويلة {v}.",
      "ru": "Когда {e} падает, звонит телефон с добавочным номером {v}."},
     "Who gets paged if {e} fails? Give the number.", "escalation"),
    ({"en": "The monthly bill for {e} must stay below {v} dollars.",
      "es": "La factura mensual de {e} no debe pasar de {v} dólares.",
      "ja": "{e} の月額費用は {v} ドル未満に抑えなければならない。",
      "ar": "يجب أن تبقى الفاتورة الشهرية لـ {e} أقل من {v} دولار.",
      "ru": "Ежемесячный счет за {e} не должен превышать {v} долларов."},
     "What is the spending cap of {e}?", "budget"),
]
_MENTIONS = {
    "en": ["The {e} dashboard was redesigned last quarter.", "Questions about {e} go to the platform channel."],
    "es": ["El panel de {e} se rediseñó el trimestre pasado.", "Las preguntas sobre {e} van al canal de plataforma."],
    "ja": ["{e} のダッシュボードは前四半期に作り直された。", "{e} についての質問はプラットフォームのチャンネルへ。"],
    "ar": ["أعيد تصميم لوحة {e} في الربع الماضي.", "الأسئلة عن {e} تذهب إلى قناة المنصة."],
    "ru": ["Панель {e} переделали в прошлом квартале.", "Вопросы про {e} задают в канале платформы."],
}


def paraphrase(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"paraphrase:{seed}")
    b = _Builder(tokens, rng)
    used: set[str] = set()
    entities = rng.sample(_ENTITIES, facts)
    templates = [_PARAPHRASES[i % len(_PARAPHRASES)] for i in range(facts)]
    rng.shuffle(templates)
    mentions = [e for e in entities for _ in range(rng.randint(1, 2))]
    rng.shuffle(mentions)
    schedule = _schedule(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1200))
        planted: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            facts_by_language, ask, kind = templates[i]
            value = _number(rng, used, 1100, 9900)
            fact = facts_by_language[language].format(e=entities[i], v=value)
            planted.append(fact)
            b.questions.append(Question(ask.format(e=entities[i]), value, (fact,), (value,), language, kind))
        for _ in range(rng.randint(0, 2)):
            if mentions:
                planted.append(rng.choice(_MENTIONS[language]).format(e=mentions.pop()))
        lines = [f"# notes/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"notes/{n:02d}-{rng.choice(_WORDS)}.md", "\n".join(lines), language)
        n += 1
    return Workload("paraphrase", seed, tuple(b.files), tuple(b.questions))


# -------------------------------------------------------------------------------------------- split

_HOST_FACTS = {
    "en": "{name} runs on the host {v}.",
    "es": "{name} se ejecuta en el host {v}.",
    "ja": "{name} はホスト {v} で動いている。",
    "ar": "تعمل {name} على المضيف {v}.",
    "ru": "{name} работает на хосте {v}.",
}
_PORT_FACTS = {
    "en": "{name} accepts connections on port {v}.",
    "es": "{name} acepta conexiones en el puerto {v}.",
    "ja": "{name} はポート {v} で接続を受け付ける。",
    "ar": "تقبل {name} الاتصالات على المنفذ {v}.",
    "ru": "{name} принимает соединения на порту {v}.",
}


def split(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 6) -> Workload:
    rng = random.Random(f"split:{seed}")
    b = _Builder(tokens, rng)
    used: set[str] = set()
    names = _names(rng, facts)
    # Two statements per fact, in two different files: the host early, the port some files later.
    slots = _schedule(b, 2 * facts, 900)
    where: list[list[tuple[int, str]]] = [[] for _ in slots]
    for i in range(facts):
        host_at = (i * len(slots)) // (2 * facts)
        port_at = min(len(slots) - 1, host_at + max(2, len(slots) // 2))
        if port_at == host_at:
            host_at = max(0, port_at - 1)
        where[host_at].append((i, "host"))
        where[port_at].append((i, "port"))
    values: dict[tuple[int, str], tuple[str, str]] = {}  # (fact, what) -> (value, statement)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1100))
        planted: list[str] = []
        for i, what in where[n] if n < len(where) else []:
            if what == "host":
                value = f"{rng.choice(_WORDS)}-{rng.randrange(16 ** 4):04x}.internal"
                while value in used:
                    value = f"{rng.choice(_WORDS)}-{rng.randrange(16 ** 4):04x}.internal"
                fact = _HOST_FACTS[language].format(name=names[i], v=value)
            else:
                value = _number(rng, used, 20000, 65000)
                fact = _PORT_FACTS[language].format(name=names[i], v=value)
            used.add(value)
            values[(i, what)] = (value, fact)
            planted.append(fact)
        lines = [f"# ops/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"ops/{n:02d}-{rng.choice(_WORDS)}.md", "\n".join(lines), language)
        n += 1
    for i in range(facts):
        if (i, "host") in values and (i, "port") in values:
            (host, host_fact), (port, port_fact) = values[(i, "host")], values[(i, "port")]
            language = next(f.language for f in b.files if host_fact in f.text)
            b.questions.append(Question(f"Which host and port does {names[i]} use? Answer as host:port.",
                                        f"{host}:{port}", (host_fact, port_fact), (host, port), language,
                                        "host_port"))
    return Workload("split", seed, tuple(b.files), tuple(b.questions))


# ----------------------------------------------------------------------------------- near_duplicate

_TIMEOUT_FACTS = {
    "en": "The connection timeout of {name} is {v} ms.",
    "es": "El tiempo de conexión de {name} es de {v} ms.",
    "ja": "{name} の接続タイムアウトは {v} ms です。",
    "ar": "مهلة الاتصال في {name} هي {v} ms.",
    "ru": "Тайм-аут соединения у {name} составляет {v} ms.",
}
_ND_FIRST = ("orders", "payments", "search", "billing", "media", "auth", "export", "ledger")
_ND_SECOND = ("api", "worker", "cache", "gateway", "sync", "indexer")


def near_duplicate(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 36, questions: int = 10) -> Workload:
    rng = random.Random(f"near_duplicate:{seed}")
    b = _Builder(tokens, rng)
    used: set[str] = set()
    names = rng.sample([f"{a}-{c}" for a in _ND_FIRST for c in _ND_SECOND], facts)
    planted: list[tuple[str, str, str, str]] = []  # (name, value, statement, language)
    schedule = _schedule(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1100))
        here: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            value = _number(rng, used, 1100, 9900)
            fact = _TIMEOUT_FACTS[language].format(name=names[i], v=value)
            here.append(fact)
            planted.append((names[i], value, fact, language))
        lines = [f"# timeouts/{n:02d} ({language})", "", *_place(body, here, rng)]
        b.add(f"config/timeouts-{n:02d}.md", "\n".join(lines), language)
        n += 1
    for name, value, fact, language in rng.sample(planted, min(questions, len(planted))):
        b.questions.append(Question(f"What is the connection timeout of {name}?", value, (fact,), (value,),
                                    language, "timeout"))
    return Workload("near_duplicate", seed, tuple(b.files), tuple(b.questions))


# ------------------------------------------------------------------------------------------- config

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
        return _prose_value(kind, rng, used)
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
    b = _Builder(tokens, rng)
    used: set[str] = set()
    services = [f"{a}-{c}" for a in _AREAS for c in ("api", "worker", "sync", "cron", "gateway")]
    rng.shuffle(services)
    schedule = _schedule(b, facts, 700)  # a config and its worker
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
                 *(f"feature_{rng.choice(_WORDS)}_{k}: {rng.choice(('true', 'false'))}" for k in range(6))]
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
    b = _Builder(tokens, rng)
    used: set[str] = set()
    suite = rng.sample(_TESTS, 40)
    failing = rng.sample(suite, facts)
    schedule = _schedule(b, facts, 900)
    n = 0
    while not b.full():
        failed: dict[str, tuple[str, str]] = {}
        for i in schedule[n] if n < len(schedule) else []:
            expected, got = _number(rng, used, 1100, 9900), _number(rng, used, 1100, 9900)
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


GENERATORS: dict[str, Callable[..., Workload]] = {
    "prose": prose, "boilerplate": boilerplate, "code": code, "paraphrase": paraphrase, "split": split,
    "near_duplicate": near_duplicate, "config": config, "logs": logs,
}


def make(shape: str, seed: int, tokens: int = DEFAULT_TOKENS) -> Workload:
    """The workload of `shape` for `seed`, about `tokens` tokens long."""
    if shape not in GENERATORS:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    workload = GENERATORS[shape](seed, tokens)
    _check(workload)
    return workload


def _check(workload: Workload) -> None:
    """Ground truth must be exact: every evidence string once in the session, answers inside it."""
    text = workload.text()
    for q in workload.questions:
        for evidence, part in zip(q.evidence, q.answer_parts, strict=True):
            count = text.count(evidence)
            if count != 1:
                raise AssertionError(f"{workload.shape}/{workload.seed}: evidence {evidence[:60]!r} occurs {count}x")
            if part not in evidence:
                raise AssertionError(f"{workload.shape}/{workload.seed}: answer {part!r} not in its evidence")
            if len(re.findall(r"(?<!\w)" + re.escape(part) + r"(?!\w)", text)) != 1:
                raise AssertionError(f"{workload.shape}/{workload.seed}: answer {part!r} is not unique")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="boilerplate", choices=SHAPES)
    parser.add_argument("--seed", type=int, default=TUNING_SEEDS[0])
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    args = parser.parse_args(argv)
    workload = make(args.shape, args.seed, args.tokens)
    print(json.dumps({"messages": workload.messages(), "tools": workload.tools,
                      "questions": [q.__dict__ for q in workload.questions]}, ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
