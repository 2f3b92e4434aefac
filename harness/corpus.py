"""A small, varied text sample for tests and benchmarks that need real-text token streams.

Prose, code, a stack trace, JSON and several scripts (Japanese, Arabic, Spanish, Russian), so the
token ids look like an agent's context rather than random integers. Nothing here is fetched.
Depends on the Tokenizer protocol only.
"""

from __future__ import annotations

from backends import Tokenizer

__all__ = ["SAMPLE_TEXT", "sample_tokens"]

SAMPLE_TEXT = """\
The harbour was quiet in the early morning. Fishing boats rocked against the pier while gulls
argued over scraps, and the smell of diesel mixed with salt. Mara checked the tide table twice
before she untied the rope: the channel would be shallow until nine, and the engine had been
making that noise again, a dry cough every few minutes that nobody had managed to explain.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Merge overlapping closed intervals; the input need not be sorted.\"\"\"
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

Traceback (most recent call last):
  File "/srv/app/worker.py", line 212, in run
    result = handler(job.payload)
  File "/srv/app/handlers.py", line 88, in resize
    width, height = payload["size"]
KeyError: 'size'

要件: すべてのリクエストは 200 ミリ秒以内に応答すること。タイムアウトした場合は、再試行を三回まで行い、
それでも失敗したらエラーログに記録してから利用者に分かりやすいメッセージを返す。

المتطلبات: يجب أن يحتفظ النظام بسجل كامل لكل عملية، وأن يرفض أي طلب لا يحمل توقيعاً صالحاً.
يجب أن تكون رسائل الخطأ واضحة ومترجمة إلى اللغة التي يستخدمها العميل.

Requisito: el informe mensual debe incluir el total de ventas por región, ordenado de mayor a
menor, y marcar en rojo cualquier región cuyo crecimiento sea negativo respecto al mes anterior.

Требование: конфигурация загружается один раз при старте; изменения во время работы не
применяются без перезапуска службы, и об этом нужно явно написать в документации.

{"id": 4821, "status": "failed", "retries": 3, "tags": ["billing", "eu-west"], "owner": null,
 "error": {"code": "E_TIMEOUT", "detail": "upstream did not answer within 30 s"}}

SELECT region, SUM(amount) AS total FROM sales WHERE month = '2025-09' GROUP BY region
ORDER BY total DESC;

The committee met again on Thursday. After two hours of discussion they agreed on three
points: the bridge would close for repairs in March, the ferry timetable would double during
the closure, and residents of the north shore would receive free passes for the duration.
"""


def sample_tokens(tokenizer: Tokenizer, n: int) -> list[int]:
    """Exactly `n` token ids of SAMPLE_TEXT, repeated as needed (no special tokens)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    ids = list(tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False))
    if not ids:
        raise ValueError("the tokenizer produced no tokens for the sample text")
    reps = n // len(ids) + 1
    return (ids * reps)[:n]
