"""Which held tokens a turn recomputes in the current view (the blend), by what they are.

A held token's K/V were computed when it was first read, next to the pages held then; many of those
have left since, and this turn's restored pages were not there. Recomputing a few tokens in the
view as it is now (`Backend.recompute`, through serving's `PageMover.blend`) buys back part of
what a fresh prefill of the view would read, at a fraction of its forward. This module only names
tokens: the parts of a turn's view (`ViewParts`) and the policy that picks from them
(`BlendPolicy`); the host runs it.

Depends on numpy and controller.pager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from controller.pager import Pager

# The parts a policy can name; "heads" is the first tokens of every run of consecutive pages.
PARTS = ("new", "restored", "tail", "pins", "heads")


@dataclasses.dataclass(frozen=True)
class ViewParts:
    """The held tokens of a turn's view at the moment its answer is about to be read, as logical
    indices (the cache's order), by what they are:

      new        the tokens this turn prefilled (the new messages, before the answer's opening)
      restored   the pages this turn brought back
      pins       pinned pages (system prompt, tools, objective)
      tail       every other held token: the recent history the pager kept

    and `runs`: the view in position order cut where a page does not follow its predecessor in the
    session, each run as the logical indices of its tokens in position order."""

    held: int
    new: np.ndarray
    restored: np.ndarray
    pins: np.ndarray
    tail: np.ndarray
    runs: list[np.ndarray]

    def part(self, name: str) -> np.ndarray:
        if name not in PARTS:
            raise ValueError(f"unknown view part {name!r}; known: {', '.join(PARTS)}")
        if name == "heads":
            raise ValueError("'heads' takes a token count: use heads(k)")
        out: np.ndarray = getattr(self, name)
        return out

    def heads(self, k: int) -> np.ndarray:
        """The first `k` tokens of every run (EPIC's recompute: where a chunk computed elsewhere keeps
        the attention sink of the context it was read in)."""
        if not self.runs:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([run[:k] for run in self.runs])


def view_parts(pager: Pager, restored: Iterable[int], new_tokens: int, positions: np.ndarray) -> ViewParts:
    """The parts of the view `pager` describes; `positions` are the cache's (`Backend.positions()`,
    logical order). `new_tokens` of the held tokens at the end of the logical order were prefilled
    this turn."""
    resident = pager.resident
    came_back = set(restored)
    pins = pager.pins
    held = int(positions.shape[0])
    spans: list[tuple[int, int, int]] = []   # (page index, first logical index, tokens)
    at = 0
    for index in resident:
        n = pager.pages[index].tokens
        spans.append((index, at, n))
        at += n
    assert at == held, "the pager and the cache disagree about what is held"
    new_from = held - min(new_tokens, held)

    def indices(pages: set[int]) -> np.ndarray:
        chosen = [np.arange(start, start + n) for index, start, n in spans if index in pages]
        return np.concatenate(chosen).astype(np.int64) if chosen else np.zeros(0, dtype=np.int64)

    new = np.arange(new_from, held, dtype=np.int64)
    back = np.setdiff1d(indices(came_back), new)
    pinned = np.setdiff1d(indices(set(pins)), new)
    tail = np.setdiff1d(np.arange(new_from, dtype=np.int64), np.concatenate([back, pinned]))
    # Runs: pages in position order, cut where a page is not the next page of the session.
    by_position = sorted(spans, key=lambda s: int(positions[s[1]]) if s[2] else 0)
    runs: list[np.ndarray] = []
    previous = -2
    for index, start, n in by_position:
        if not n:
            continue
        tokens = np.arange(start, start + n, dtype=np.int64)
        tokens = tokens[np.argsort(positions[tokens], kind="stable")]
        if index == previous + 1 and runs:
            runs[-1] = np.concatenate([runs[-1], tokens])
        else:
            runs.append(tokens)
        previous = index
    return ViewParts(held, new, back, pinned, tail, runs)


@dataclasses.dataclass(frozen=True)
class BlendPolicy:
    """What a turn that restored pages recomputes: the named parts, the first `heads` tokens of every
    run, all within `budget` (a share of the view's tokens; what does not fit is cut, the parts'
    order deciding). An empty policy recomputes nothing (the exact cache: no forward over history
    at all)."""

    parts: tuple[str, ...] = ()
    heads: int = 0
    budget: float = 0.2

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS or p == "heads"]
        if unknown:
            raise ValueError(f"unknown blend parts {unknown}; known: {', '.join(p for p in PARTS if p != 'heads')}")
        if self.heads < 0:
            raise ValueError(f"blend heads must be >= 0, got {self.heads}")
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"the blend budget is a share of the view, 0..1, not {self.budget}")

    @property
    def off(self) -> bool:
        return not self.parts and not self.heads or self.budget == 0.0

    def choose(self, parts: ViewParts) -> np.ndarray:
        """The logical indices to recompute, at most `budget` of the view, in the policy's order of
        preference (heads first, then the parts as named), returned sorted. Nothing on a turn that
        brought nothing back: its new tokens were computed in the view they are read in, and the
        pages held were computed in views this turn did not change (only evictions took tokens
        out), so a turn that reads files pays no blend."""
        if self.off or not parts.restored.shape[0]:
            return np.zeros(0, dtype=np.int64)
        room = int(self.budget * parts.held)
        wanted = [parts.heads(self.heads)] if self.heads else []
        wanted += [parts.part(name) for name in self.parts]
        chosen: list[int] = []
        seen: set[int] = set()
        for group in wanted:
            for i in group.tolist():
                if len(chosen) >= room:
                    break
                if i not in seen:
                    seen.add(i)
                    chosen.append(i)
        return np.asarray(sorted(chosen), dtype=np.int64)


# What `kv-elision serve` recomputes unless told otherwise: the turn's new message (its K/V were
# computed before the turn's restores came back and were placed before it), then the restored
# pages (computed where they were first read), at most a fifth of the view. Chosen on tuning seed 7
# (benchmarks.blend; docs/results/blend.md).
DEFAULT_BLEND = BlendPolicy(parts=("new", "restored"), budget=0.2)
