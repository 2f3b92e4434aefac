"""A deterministic agent-like workload: evidence files in several languages, read by tool calls.

The session looks like a coding agent's: a system prompt with tool schemas, an objective, then
for each evidence file the agent calls `read`, gets the file back as a tool result and is asked to
note what matters; code and stack traces sit among requirements written in English, Japanese,
Arabic, Spanish and Russian. Facts are planted once (`Fact`), so a later question can check
whether the model still reaches them. Everything is generated from a seed: no data set is
downloaded.

Used by the demo, the long-session test and the session and selector benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = ("You are a careful coding agent working in a repository. Read the evidence files the user "
                 "points you to, remember the requirements they state, and answer questions about them exactly.")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read", "description": "Read a file from the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
]
OBJECTIVE = ("Objective: read every evidence file under evidence/, collect the requirements they state, then "
             "fix the failing tests. At the end I will ask you about specific facts from the files.")

_LANGUAGES = ("en", "ja", "ar", "es", "ru", "code")

_SENTENCES = {
    "en": ["The billing service must retry failed charges {n} times before it gives up.",
           "Requests from the {w} region are routed through the secondary gateway.",
           "Every export file is compressed and its checksum is written next to it.",
           "The nightly job deletes temporary uploads older than {n} hours.",
           "Audit logs are kept for {n} days and then moved to cold storage.",
           "A user with the {w} role may approve refunds up to {n} euros."],
    "ja": ["請求サービスは失敗した課金を{n}回まで再試行しなければならない。",
           "{w}地域からのリクエストは予備のゲートウェイを経由する。",
           "すべてのエクスポートファイルは圧縮され、チェックサムが横に書かれる。",
           "夜間ジョブは{n}時間より古い一時アップロードを削除する。",
           "監査ログは{n}日間保存され、その後コールドストレージに移される。"],
    "ar": ["يجب أن تعيد خدمة الفوترة محاولة الرسوم الفاشلة {n} مرات.",
           "تمر الطلبات القادمة من منطقة {w} عبر البوابة الثانوية.",
           "يتم ضغط كل ملف تصدير وتكتب قيمة التحقق بجانبه.",
           "تحذف المهمة الليلية الملفات المؤقتة الأقدم من {n} ساعة."],
    "es": ["El servicio de facturación debe reintentar los cobros fallidos {n} veces.",
           "Las solicitudes de la región {w} pasan por la pasarela secundaria.",
           "Cada archivo exportado se comprime y su suma de control se guarda al lado.",
           "Los registros de auditoría se conservan {n} días y luego se archivan."],
    "ru": ["Сервис оплаты должен повторять неудачные списания {n} раз.",
           "Запросы из региона {w} идут через резервный шлюз.",
           "Каждый файл экспорта сжимается, а его контрольная сумма пишется рядом.",
           "Ночная задача удаляет временные загрузки старше {n} часов."],
}
_WORDS = ("north", "amber", "delta", "harbor", "quartz", "meadow", "cobalt", "summit")
_CODE = ['''def retry_charge(charge, attempts={n}):
    for attempt in range(attempts):
        if gateway.charge(charge):
            return True
        time.sleep(2 ** attempt)
    return False
''', '''Traceback (most recent call last):
  File "billing/worker.py", line {n}, in run
    result = retry_charge(job.charge)
  File "billing/retry.py", line 12, in retry_charge
    raise GatewayTimeout("{w} gateway did not answer")
billing.errors.GatewayTimeout: {w} gateway did not answer
''', '''class ExportWriter:
    def write(self, rows):
        data = gzip.compress(serialize(rows))
        (self.folder / "export.gz").write_bytes(data)
        (self.folder / "export.gz.sum").write_text(checksum(data))  # {w}-{n}
''']


@dataclass(frozen=True)
class Fact:
    """A fact planted once in one file, and the question that checks it."""

    file_index: int
    language: str
    statement: str
    question: str
    answer: str


_FACT_TEMPLATES = {
    "en": ("The deployment passphrase for release {k} is {a}.", "What is the deployment passphrase for release {k}?"),
    "ja": ("リリース{k}のデプロイ用パスフレーズは{a}です。", "リリース{k}のデプロイ用パスフレーズは何ですか？"),
    "ar": ("عبارة المرور للإصدار {k} هي {a}.", "ما هي عبارة المرور للإصدار {k}؟"),
    "es": ("La contraseña de despliegue de la versión {k} es {a}.",
           "¿Cuál es la contraseña de despliegue de la versión {k}?"),
    "ru": ("Пароль развертывания для релиза {k} — {a}.", "Какой пароль развертывания для релиза {k}?"),
    "code": ("DEPLOY_PASSPHRASE_{k} = \"{a}\"  # required by the release checklist",
             "What value is DEPLOY_PASSPHRASE_{k} set to?"),
}


@dataclass(frozen=True)
class EvidenceFile:
    path: str
    language: str
    text: str
    facts: tuple[Fact, ...]


def evidence_files(count: int, tokens_per_file: int = 1200, facts_per_file: int = 1, seed: int = 7
                   ) -> list[EvidenceFile]:
    """`count` files of roughly `tokens_per_file` tokens, languages in rotation, facts planted."""
    rng = random.Random(seed)
    files = []
    for index in range(count):
        language = _LANGUAGES[index % len(_LANGUAGES)]
        facts = []
        for f in range(facts_per_file):
            code = f"{rng.choice(_WORDS).upper()}-{rng.randint(1000, 9999)}"
            release = f"{index + 1}.{f}"
            statement, question = _FACT_TEMPLATES[language]
            facts.append(Fact(index, language, statement.format(k=release, a=code), question.format(k=release),
                              code))
        lines: list[str] = [f"# evidence/{index:02d} ({language})", ""]
        budget_chars = tokens_per_file * (2 if language in ("ja", "ar", "ru") else 4)
        fact_at = sorted(rng.sample(range(3, 40), facts_per_file))
        n = 0
        while sum(len(line) + 1 for line in lines) < budget_chars:
            if fact_at and n == fact_at[0]:
                lines.append(facts[len(facts) - len(fact_at)].statement)
                fact_at.pop(0)
            elif language == "code" or rng.random() < 0.12:
                lines.append(rng.choice(_CODE).format(n=rng.randint(2, 400), w=rng.choice(_WORDS)))
            else:
                pool = _SENTENCES[language if language in _SENTENCES else "en"]
                lines.append(rng.choice(pool).format(n=rng.randint(2, 90), w=rng.choice(_WORDS)))
            n += 1
        for pending in fact_at:  # a short file still carries its facts
            lines.append(facts[len(facts) - len(fact_at)].statement)
            del pending
        files.append(EvidenceFile(f"evidence/{index:02d}.md", language, "\n".join(lines), tuple(facts)))
    return files


def agent_turns(files: list[EvidenceFile]) -> Iterator[list[dict[str, Any]]]:
    """The messages each turn adds: a tool call to read the next file, its result, a request."""
    for n, file in enumerate(files):
        call = {"id": f"call_{n:03d}", "type": "function",
                "function": {"name": "read", "arguments": f'{{"path": "{file.path}"}}'}}
        yield [{"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": file.text},
               {"role": "user", "content": f"Note the requirements in {file.path} in one sentence."}]


def opening_messages() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": OBJECTIVE}]
