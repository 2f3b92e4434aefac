"""Host rules around the controller: strict parsing, ID validation, budget, deadlines, no language logic."""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from contextd.wire import PageState, PinKind
from controller.keyindex import KeyIndex, KeyIndexConfig
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig
from controller.planner import PlanError, UnitPlan, parse_plan, parse_units, plan_prompt, validate
from controller.selectors import AttentionSelector, ControllerSelector, SelectionContext
from controller.units import CLUSTER_UNITS, UnitIndex

REPO = Path(__file__).resolve().parents[2]


def session(pages: int = 80, budget: int = 2048) -> tuple[Pager, UnitIndex]:
    pager = Pager(PagerConfig(budget_tokens=budget))
    pager.append(list(range(256)), pin=PinKind.SYSTEM)
    pager.append(list(range(pages * PAGE_TOKENS - 256)))
    for page in pager.pages[2:-8]:
        page.stored = True
    pager.apply(Decision(evict=[p.index for p in pager.pages[2:-8]], restore=[], plan_used=False))
    units = UnitIndex()
    units.update(pager, message_end_pages=set(range(0, pages, 7)))
    return pager, units


class ScriptedController:
    """A controller model that answers what a test needs, to exercise the host's rules against
    answers a real small model gives only by chance (garbage, hostile ids, lateness)."""

    name = "scripted"

    def __init__(self, answers: list[str], delay_s: float = 0.0) -> None:
        self.answers = answers
        self.delay_s = delay_s
        self.tokens_processed = 0
        self.prompts: list[str] = []

    def complete(self, prompt: str, max_tokens: int) -> str:
        self.prompts.append(prompt)
        time.sleep(self.delay_s)
        return self.answers.pop(0) if self.answers else "{}"


@pytest.mark.parametrize("answer", ["", "restore everything", "{", '{"restore": ["u1"', "[1, 2]", "null",
                                    '{"restore": "u1"}', '{"restore": [1, 2]}', '{"restore": [], "delete": ["u1"]}',
                                    '{"restore": [' + ",".join(['"u"'] * 65) + "]}"])
def test_rubbish_answers_are_refused(answer: str) -> None:
    with pytest.raises(PlanError):
        parse_plan(answer)


def test_a_plan_wrapped_in_prose_is_read_and_strings_with_braces_survive() -> None:
    plan = parse_plan('Sure! Here it is: {"restore": ["u{a}"], "pin": [], "evict_first": ["x"]} hope it helps')
    assert plan.restore == ["u{a}"] and plan.evict_first == ["x"]
    assert parse_units('{"units": ["a", "b"]}') == ["a", "b"]
    with pytest.raises(PlanError):
        parse_units('{"units": ["a"], "more": 1}')


def test_ids_are_opaque_and_validated_against_the_session() -> None:
    pager, units = session()
    other_pager, other_units = session()
    # 12 hex digits of a salted hash: no position, no text, nothing ordered a model could exploit.
    assert len(units.units) >= 8 and all(re.fullmatch(r"u[0-9a-f]{12}", u) for u in units.units)
    assert set(units.units).isdisjoint(other_units.units)  # salted: another session's ids mean nothing here
    mine = units.order[1]
    hard = units.order[0]  # holds the hard-pinned opening pages
    plan = UnitPlan(restore=[mine, mine, other_units.order[2], "../../x"], pin=[],
                    evict_first=[hard, units.order[3]])
    checked = validate(plan, units, pager)
    assert checked.plan.restore == [p for p in units.units[mine].pages if pager.pages[p].state is PageState.COLD]
    assert not set(checked.plan.evict_first) & {0, 1}
    assert any("unknown id" in d for d in checked.dropped) and any("duplicate" in d for d in checked.dropped)
    assert any("pinned" in d for d in checked.dropped)


def test_a_plan_over_budget_evicts_nothing_because_of_it() -> None:
    pager, units = session()
    everything = [u for u in units.order if any(pager.pages[p].state is PageState.COLD for p in units.units[u].pages)]
    plan = validate(UnitPlan(restore=everything), units, pager).plan
    decision = pager.decide(plan)
    assert not decision.plan_used and decision.evict == [] and decision.restore == []


def test_units_are_whole_pages_about_1024_tokens_in_clusters_of_eight() -> None:
    pager, units = session(pages=200)
    sizes = [len(units.units[u].pages) for u in units.order]
    assert all(6 <= n <= 10 for n in sizes)
    pages = [p for u in units.order for p in units.units[u].pages]
    assert pages == sorted(pages) and len(set(pages)) == len(pages)
    assert all(len(c.unit_ids) <= CLUSTER_UNITS for c in units.clusters.values())
    assert sum(c.closed for c in units.clusters.values()) == len(units.order) // CLUSTER_UNITS


def test_a_late_plan_runs_on_default_retention_then_applies_next_turn() -> None:
    pager, units = session()
    target = units.order[2]
    model = ScriptedController([f'{{"restore": ["{target}"]}}'], delay_s=0.6)
    selector = ControllerSelector(model, deadline_s=0.1)
    context = SelectionContext("s", pager, units, "next message", room_tokens=1500)
    first = selector.select(context)
    assert first.plan is None and "next turn" in first.note
    time.sleep(0.8)
    second = selector.select(context)
    assert second.plan is not None and "late plan" in second.note
    assert set(second.plan.restore) == {p for p in units.units[target].pages if pager.pages[p].state is PageState.COLD}


def test_a_garbage_or_failing_controller_never_fails_the_turn() -> None:
    pager, units = session()
    for answer in ("I think you should restore the config file", '{"restore": ["nope"]}'):
        selector = ControllerSelector(ScriptedController([answer]), deadline_s=2.0)
        selection = selector.select(SelectionContext("s", pager, units, "msg", room_tokens=1500))
        assert selection.plan is None or selection.plan.restore == []

    class Broken(ScriptedController):
        def complete(self, prompt: str, max_tokens: int) -> str:
            raise ConnectionError("controller endpoint down")

    selection = ControllerSelector(Broken([]), deadline_s=2.0).select(SelectionContext("s", pager, units, "m",
                                                                                          room_tokens=1500))
    assert selection.plan is None and "controller failed" in selection.note


LANGUAGE_UNITS = {
    "en": "The billing service must retry failed charges 5 times.",
    "ja": "請求サービスは失敗した課金を5回まで再試行しなければならない。",
    "ar": "يجب أن تعيد خدمة الفوترة محاولة الرسوم الفاشلة 5 مرات.",
    "es": "El servicio de facturación debe reintentar los cobros fallidos 5 veces.",
    "ru": "Сервис оплаты должен повторять неудачные списания 5 раз.",
    "code": "def retry(charge):\n    for attempt in range(5):\n        gateway.charge(charge)",
}


@pytest.mark.parametrize("language", sorted(LANGUAGE_UNITS))
def test_the_same_host_path_for_every_language(language: str) -> None:
    pager, units = session()
    target = units.order[-1]  # in the open cluster: the plan prompt lists it by itself
    units.units[target].summary = LANGUAGE_UNITS[language]
    calls: list[str] = []
    model = ScriptedController([f'{{"restore": ["{target}"], "pin": [], "evict_first": []}}'])
    selector = ControllerSelector(model, deadline_s=5.0)
    selection = selector.select(SelectionContext("s", pager, units, LANGUAGE_UNITS[language], room_tokens=1500))
    calls.append(type(selection.plan).__name__)
    assert selection.plan is not None and selection.plan.restore
    assert LANGUAGE_UNITS[language] in model.prompts[0]  # the text goes to the model untouched
    assert plan_prompt(LANGUAGE_UNITS[language], units, 2).count(target) == 1


SERVING_HOST = ("engine.py", "paging.py", "session.py", "http.py", "transcript.py")
HOST_FILES = [*sorted((REPO / "controller").glob("*.py")), *(REPO / "serving" / name for name in SERVING_HOST)]
LANGUAGE_MARKERS = {"en", "ja", "ar", "es", "ru", "zh", "english", "japanese", "arabic", "spanish", "russian",
                    "chinese", "cjk", "hiragana", "katakana", "cyrillic", "latin"}


@pytest.mark.parametrize("path", HOST_FILES, ids=lambda p: p.name)
def test_no_language_specific_branch_anywhere_in_the_host(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
            assert not {"unicodedata", "langdetect", "langid", "regex"} & set(names), f"{path.name} imports {names}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value.isascii(), f"{path.name}:{node.lineno} has a non-ASCII literal {node.value[:20]!r}"
            assert node.value.lower() not in LANGUAGE_MARKERS, f"{path.name}:{node.lineno} names a language"
            assert "\\p{" not in node.value and "\\u3040" not in node.value, f"{path.name}:{node.lineno} script range"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            assert node.func.attr not in ("isalpha", "isascii") or path.name == "http.py", \
                f"{path.name}:{node.lineno} inspects characters"


def _block_keys(vectors: np.ndarray, layers: int = 4, kv_heads: int = 2) -> np.ndarray:
    """Token vectors [tokens, kv_heads * dim] laid out as Block keys [layers, kv_heads, tokens, dim]."""
    tokens = vectors.shape[0]
    per_head = vectors.reshape(tokens, kv_heads, -1).transpose(1, 0, 2)
    return np.repeat(per_head[None], layers, axis=0).astype(np.float32)


def test_key_index_finds_the_page_that_shares_rare_tokens_with_the_incoming_message() -> None:
    rng = np.random.default_rng(0)
    vocabulary = rng.normal(size=(400, 32)).astype(np.float32)
    common = rng.choice(200, size=40, replace=False)          # template-like tokens: in every page
    index = KeyIndex(KeyIndexConfig(), attention_layers=4)
    planted = np.array([301, 302, 303])
    for page in range(30):
        ids = np.concatenate([common, rng.choice(200, size=88)])
        if page == 17:
            ids[50:53] = planted
        index.add(page, _block_keys(vocabulary[ids]))
    incoming = _block_keys(vocabulary[np.concatenate([common[:20], planted, common[20:30]])])
    scores = index.scores(incoming, list(range(30)))
    assert int(np.argmax(scores)) == 17
    # Tokens present in every page weigh nothing: alone they name no page.
    flat = index.scores(_block_keys(vocabulary[common]), list(range(30)))
    assert np.ptp(flat) < 1e-6
    assert index.nbytes == 30 * 128 * 32 * 2


def test_key_index_layer_choice_truncation_and_config() -> None:
    assert KeyIndexConfig().layer(30) == 7 and KeyIndexConfig().layer(1) == 0
    assert KeyIndexConfig(layer_fraction=1.0).layer(12) == 11
    for bad in ({"layer_fraction": 1.5}, {"match_threshold": 1.0}, {"match_floor": 0.95}, {"incoming_tokens": 0}):
        with pytest.raises(ValueError):
            KeyIndexConfig(**bad)  # type: ignore[arg-type]
    index = KeyIndex(KeyIndexConfig(), attention_layers=4)
    for page in range(5):
        index.add(page, np.ones((4, 2, 128, 8), dtype=np.float32))
    index.truncate(3)
    assert sorted(index.pages) == [0, 1, 2]
    index.clear()
    assert not index.pages


def test_attention_selector_restores_the_best_cold_pages_that_fit_the_room() -> None:
    pager, units = session()
    rng = np.random.default_rng(1)
    vocabulary = rng.normal(size=(400, 32)).astype(np.float32)
    index = KeyIndex(KeyIndexConfig(), attention_layers=4)
    cold = [p.index for p in pager.pages if p.state is PageState.COLD]
    for page in cold:
        index.add(page, _block_keys(vocabulary[rng.choice(300, size=128)]))
    target = cold[3]
    index.add(target, _block_keys(vocabulary[np.concatenate([np.arange(350, 360), rng.choice(300, 118)])]))
    incoming = _block_keys(vocabulary[np.arange(350, 360)])
    selector = AttentionSelector(max_pages=2)
    chosen = selector.select(SelectionContext("s", pager, units, "", incoming_keys=incoming, key_index=index,
                                              room_tokens=4 * PAGE_TOKENS))
    assert chosen.plan is not None and target in chosen.plan.restore and len(chosen.plan.restore) == 2
    tight = selector.select(SelectionContext("s", pager, units, "", incoming_keys=incoming, key_index=index,
                                             room_tokens=PAGE_TOKENS - 1))
    assert tight.plan is not None and tight.plan.restore == []
    assert selector.select(SelectionContext("s", pager, units, "")).plan is None
    with pytest.raises(ValueError):
        AttentionSelector(max_pages=0)


def test_selectors_are_safe_to_call_from_the_worker_while_summaries_run() -> None:
    pager, units = session()
    model = ScriptedController(["a summary"] * 40, delay_s=0.01)
    selector = ControllerSelector(model, deadline_s=1.0)
    context = SelectionContext("s", pager, units, "")
    selector.after_turn(context, [units.units[u] for u in units.order[:3]], lambda u: "text")
    done = threading.Event()
    threading.Thread(target=lambda: (selector.wait_idle(), done.set())).start()
    assert done.wait(10) and all(units.units[u].summary == "a summary" for u in units.order[:3])


def test_a_named_cluster_is_refined_into_its_units_with_a_second_call() -> None:
    pager, units = session()
    closed = next(c for c in units.clusters.values() if c.closed)
    prompt = plan_prompt("next", units, 2)
    assert closed.cluster_id in prompt and not any(u in prompt for u in closed.unit_ids)
    inside = next(u for u in closed.unit_ids if any(pager.pages[p].state is PageState.COLD
                                                    for p in units.units[u].pages))
    model = ScriptedController([f'{{"restore": ["{closed.cluster_id}"]}}', f'{{"units": ["{inside}"]}}'])
    selection = ControllerSelector(model, deadline_s=5.0).select(
        SelectionContext("s", pager, units, "next", room_tokens=1500))
    assert len(model.prompts) == 2 and all(u in model.prompts[1] for u in closed.unit_ids)
    assert selection.plan is not None
    assert selection.plan.restore == [p for p in units.units[inside].pages if pager.pages[p].state is PageState.COLD]


def test_a_cut_back_timeline_gets_the_units_a_fresh_index_would_give() -> None:
    pager, units = session(pages=120)
    ends = set(range(0, 120, 7))
    cut = units.units[units.order[5]].pages[3]  # in the middle of a closed unit
    pager.truncate(cut * PAGE_TOKENS + 5)
    units.truncate(len(pager.pages))
    pager.append(list(range(20 * PAGE_TOKENS)))
    units.update(pager, ends)
    fresh = UnitIndex(units.salt)
    fresh.update(pager, ends)
    assert [units.units[u].pages for u in units.order] == [fresh.units[u].pages for u in fresh.order]
    assert units.order == fresh.order
