"""The notes family: facts stated as sentences in Markdown notes of filler prose, in five languages.

Each file is a note of filler sentences in one of LANGUAGES (rotating with the file and the
seed), with the facts of its turn inserted at random lines. The shapes differ in how a question
reaches its fact:

  prose           facts stated in prose files, in five languages; each question is asked in its
                  fact's language and names the thing (like harness.workload).
  paraphrase      the question shares little with the fact but the name of the thing: "How long
                  does Heron keep its backups?" for "Snapshots of Heron are deleted after 4120
                  hours." Each name is also mentioned in unrelated sentences elsewhere.
  split           two attributes of one thing stated in two different files (host in one, port in
                  the other, often in two languages); both pages are needed.
  near_duplicate  dozens of facts of the same sentence that differ only in the service they name
                  and the value ("The connection timeout of orders-api is 4312 ms."), with names
                  that share parts (orders-api, orders-worker, payments-api); the selector must
                  prefer the one the question names.

Dependency rules: the standard library, harness.shapes.session and harness.shapes.building;
never the registry (harness.shapes), which imports this module.
"""

from __future__ import annotations

import random

from harness.shapes.building import WORDS, Builder, fact_value, schedule_facts, unique_number
from harness.shapes.session import DEFAULT_TOKENS, LANGUAGES, Question, Workload, approx_tokens

# ------------------------------------------------------------------------------------------- filler

_FIRST = ("ledger", "atlas", "orion", "ember", "quill", "nimbus", "harbor", "tundra", "cobalt", "falcon", "maple",
          "zephyr", "granite", "lumen", "vesper", "cinder", "alpine", "juniper", "onyx", "saffron")
_SECOND = ("sync", "gateway", "worker", "cache", "relay", "indexer", "scheduler", "vault", "bridge", "proxy")

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


def _filler(rng: random.Random, language: str) -> str:
    return rng.choice(_FILLER[language]).format(n=rng.randint(2, 90), w=rng.choice(WORDS))


def _names(rng: random.Random, count: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in _FIRST for b in _SECOND]
    return rng.sample(pairs, count)


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


def prose(seed: int, tokens: int = DEFAULT_TOKENS, facts: int = 10) -> Workload:
    rng = random.Random(f"prose:{seed}")
    b = Builder(tokens, rng)
    used: set[str] = set()
    names = _names(rng, facts)
    schedule = schedule_facts(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1200))
        planted: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            kind = rng.choice(sorted(_PROSE_FACTS))
            statement, question = _PROSE_FACTS[kind][language]
            value = fact_value(kind, rng, used)
            fact = statement.format(name=names[i], v=value)
            planted.append(fact)
            b.questions.append(Question(question.format(name=names[i]), value, (fact,), (value,), language, kind))
        lines = [f"# docs/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"docs/{n:02d}-{rng.choice(WORDS)}.md", "\n".join(lines), language)
        n += 1
    return Workload("prose", seed, tuple(b.files), tuple(b.questions))


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
    b = Builder(tokens, rng)
    used: set[str] = set()
    entities = rng.sample(_ENTITIES, facts)
    templates = [_PARAPHRASES[i % len(_PARAPHRASES)] for i in range(facts)]
    rng.shuffle(templates)
    mentions = [e for e in entities for _ in range(rng.randint(1, 2))]
    rng.shuffle(mentions)
    schedule = schedule_facts(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1200))
        planted: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            facts_by_language, ask, kind = templates[i]
            value = unique_number(rng, used, 1100, 9900)
            fact = facts_by_language[language].format(e=entities[i], v=value)
            planted.append(fact)
            b.questions.append(Question(ask.format(e=entities[i]), value, (fact,), (value,), language, kind))
        for _ in range(rng.randint(0, 2)):
            if mentions:
                planted.append(rng.choice(_MENTIONS[language]).format(e=mentions.pop()))
        lines = [f"# notes/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"notes/{n:02d}-{rng.choice(WORDS)}.md", "\n".join(lines), language)
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
    b = Builder(tokens, rng)
    used: set[str] = set()
    names = _names(rng, facts)
    # Two statements per fact, in two different files: the host early, the port some files later.
    slots = schedule_facts(b, 2 * facts, 900)
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
                value = f"{rng.choice(WORDS)}-{rng.randrange(16 ** 4):04x}.internal"
                while value in used:
                    value = f"{rng.choice(WORDS)}-{rng.randrange(16 ** 4):04x}.internal"
                fact = _HOST_FACTS[language].format(name=names[i], v=value)
            else:
                value = unique_number(rng, used, 20000, 65000)
                fact = _PORT_FACTS[language].format(name=names[i], v=value)
            used.add(value)
            values[(i, what)] = (value, fact)
            planted.append(fact)
        lines = [f"# ops/{n:02d} ({language})", "", *_place(body, planted, rng)]
        b.add(f"ops/{n:02d}-{rng.choice(WORDS)}.md", "\n".join(lines), language)
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
    b = Builder(tokens, rng)
    used: set[str] = set()
    names = rng.sample([f"{a}-{c}" for a in _ND_FIRST for c in _ND_SECOND], facts)
    planted: list[tuple[str, str, str, str]] = []  # (name, value, statement, language)
    schedule = schedule_facts(b, facts, 950)
    n = 0
    while not b.full():
        language = LANGUAGES[(n + seed) % len(LANGUAGES)]
        body = _prose_lines(rng, language, rng.randint(700, 1100))
        here: list[str] = []
        for i in schedule[n] if n < len(schedule) else []:
            value = unique_number(rng, used, 1100, 9900)
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
