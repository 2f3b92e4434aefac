"""Selectors by themselves: the model-native key index, the attention selector, and no language
logic anywhere in the host."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from contextd.wire import PageState, PinKind
from controller.keyindex import KeyIndex, KeyIndexConfig
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig
from controller.selectors import AttentionSelector, SelectionContext

REPO = Path(__file__).resolve().parents[2]


def session(pages: int = 80, budget: int = 2048) -> Pager:
    pager = Pager(PagerConfig(budget_tokens=budget))
    pager.append(list(range(256)), pin=PinKind.SYSTEM)
    pager.append(list(range(pages * PAGE_TOKENS - 256)))
    for page in pager.pages[2:-8]:
        page.stored = True
    pager.apply(Decision(evict=[p.index for p in pager.pages[2:-8]], restore=[], plan_used=False))
    return pager


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
    pager = session()
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
    chosen = selector.select(SelectionContext("s", pager, incoming_keys=incoming, key_index=index,
                                              room_tokens=4 * PAGE_TOKENS))
    assert chosen.plan is not None and target in chosen.plan.restore and len(chosen.plan.restore) == 2
    tight = selector.select(SelectionContext("s", pager, incoming_keys=incoming, key_index=index,
                                             room_tokens=PAGE_TOKENS - 1))
    assert tight.plan is not None and tight.plan.restore == []
    assert selector.select(SelectionContext("s", pager)).plan is None
    with pytest.raises(ValueError):
        AttentionSelector(max_pages=0)
