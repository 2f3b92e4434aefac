"""The session table's rules: what stays in memory, who keeps a cache, and who is told.

Caches are opaque to the table (it never calls one), so plain objects stand in for them here;
the engine-level behaviour (a session let go comes back from contextd) is in
tests/serving/test_engine.py.
"""

from __future__ import annotations

from typing import cast

import pytest

from backends import Backend
from controller.pager import Pager, PagerConfig
from serving.session import Session
from serving.session_table import SessionTable
from serving.transcript import Fingerprint, Transcript


class Cache:
    """Stands for a backend fork: only its identity matters to the table."""

    def __init__(self, name: str) -> None:
        self.name = name


def session(name: str) -> Session:
    return Session(name, Transcript(Fingerprint("t", "c", "x", "d")), Pager(PagerConfig(budget_tokens=4096)))


def table(resident: int, in_memory: int) -> tuple[SessionTable, list[str]]:
    made = iter(range(100))
    t = SessionTable(cast(Backend, Cache("first")), resident=resident, in_memory=in_memory,
                     fork=lambda: cast(Backend, Cache(f"fork{next(made)}")))
    told: list[str] = []
    t.on_drop(told.append)
    return t, told


def test_the_least_recently_used_idle_session_leaves_and_listeners_are_told() -> None:
    t, told = table(resident=1, in_memory=2)
    for name in ("a", "b"):
        t.add(session(name))
    t.touch("a")
    assert t.add(session("c")) == ["b"]
    assert list(t) == ["a", "c"] and told == ["b"] and t.dropped == 1


def test_a_listener_taken_off_is_told_nothing_more() -> None:
    t, told = table(resident=1, in_memory=1)
    later: list[str] = []
    t.on_drop(later.append)
    t.add(session("a"))
    t.add(session("b"))
    t.off_drop(later.append)
    t.add(session("c"))
    assert told == ["a", "b"] and later == ["a"]
    with pytest.raises(ValueError):
        t.off_drop(later.append)


def test_a_session_with_a_turn_or_a_cache_never_leaves_memory() -> None:
    t, told = table(resident=1, in_memory=1)
    t.add(session("busy"))
    t.take_cache("busy")          # resident: its cache holds its hot pages
    t.add(session("turning"))
    t.begin_turn("turning")
    assert t.add(session("new")) == []
    assert set(t) == {"busy", "turning", "new"} and told == []   # over the bound until they are idle
    t.end_turn("turning")
    assert t.add(session("newer")) == ["turning", "new"]
    assert set(t) == {"busy", "newer"}


def test_caches_go_to_the_least_recently_used_idle_session_first() -> None:
    t, _ = table(resident=2, in_memory=4)
    first = t.take_cache("a")
    second = t.take_cache("b")
    assert first is not second and t.take_cache("a") is first   # its own, and now the most recent
    t.begin_turn("b")
    assert t.take_cache("c") is first   # "b" has a turn in progress: "a" gives its cache up
    assert t.cache_of("a") is None
    t.begin_turn("c")
    with pytest.raises(RuntimeError, match="turn in progress"):
        t.take_cache("d")


def test_drop_hands_the_cache_back_and_forgets_the_active_session() -> None:
    t, told = table(resident=1, in_memory=2)
    t.add(session("a"))
    cache = t.take_cache("a")
    t.active = "a"
    assert t.drop("a") is cache and t.active is None and "a" not in t and told == ["a"]
    t.give_back(cache)
    assert t.take_cache("b") is cache


def test_a_second_turn_of_one_session_is_refused_and_bounds_are_checked() -> None:
    t, _ = table(resident=1, in_memory=1)
    t.begin_turn("a")
    with pytest.raises(RuntimeError, match="already has a turn"):
        t.begin_turn("a")
    with pytest.raises(ValueError, match="at least the resident"):
        table(resident=3, in_memory=2)
