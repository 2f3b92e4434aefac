"""Pages, states, budget, watermarks, pins, the ledger, the tail and leases: free of tensors.

The pager decides *which* 128-token pages of a session are in attention; the engine carries
the decisions out on a backend and records them in contextd. Everything here is arithmetic over
page indices, so it is tested without a model.

A page's state is contextd.wire's PageState, HOT or COLD here (DROPPED and CORRUPT are the
store's own); a pin is not a state but the page's `pin`, of contextd.wire's PinKind, and a lease
its `lease_until_turn`, as contextd keeps them in its pins and leases tables. Sharing the enums
means a state crosses to contextd as its number and a pin as its kind's string, with no map.

Rules, in the order they win:
  1. hard pins (system prompt, tool schemas, opening objective) never leave; together they are
     capped at `pin_cap_fraction` of the budget (1/4), pages past the cap stay evictable and a
     warning is logged;
  2. the ledger: the pages holding tool-call boundaries stay, the most recent first, up to
     `ledger_cap_fraction` of the budget;
  3. the recent tail (`tail_tokens`, and the open page being written) stays;
  4. restored pages hold a lease for `lease_turns` turns: the default retention does not take
     them, and a later turn's restores may take only `lease_yield_tokens` of their room (`room`);
  5. above the high watermark, evict until at or under the low one: first in the order of a valid
     plan, then the default retention (oldest unpinned first).
Beside the rules, the pager keeps the session's prefix chain (`PrefixChain`): a hash per full page
that names every token before its end, the key under which contextd indexes stored pages so a
new session can start from a stored history it begins with. Every page carries the hash up to its
own end (`Page.prefix_hash`) and its id carries that hash: the id names one version of the page,
so the pages of two histories (a cut back and regrown, an edit, a retried answer) never share an
id, and storing one never replaces a payload that a durable session record still names.
Depends on xxhash and contextd.wire (PageState, PinKind) only.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from contextd.wire import PageState, PinKind

log = logging.getLogger("kv_elision.pager")

PAGE_TOKENS = 128


@dataclass(frozen=True)
class PagerConfig:
    """Budget and policy knobs; validated so a bad configuration fails at start, not mid-session."""

    budget_tokens: int
    high_watermark: float = 1.0
    low_watermark: float = 0.875
    tail_tokens: int = 512
    pin_cap_fraction: float = 0.25
    ledger_cap_fraction: float = 0.125
    lease_turns: int = 2
    lease_yield_tokens: int = 2 * PAGE_TOKENS   # room earlier turns' restores give up to this turn's (see `room`)

    def __post_init__(self) -> None:
        if self.budget_tokens < 4 * PAGE_TOKENS:
            raise ValueError(f"budget of {self.budget_tokens} tokens is under 4 pages of {PAGE_TOKENS}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        if not 0.0 <= self.pin_cap_fraction <= 0.5 or not 0.0 <= self.ledger_cap_fraction <= 0.5:
            raise ValueError("pin and ledger caps are fractions of the budget in [0, 0.5]")
        if self.tail_tokens < 0 or self.lease_turns < 0 or self.lease_yield_tokens < 0:
            raise ValueError("tail_tokens, lease_turns and lease_yield_tokens must not be negative")
        reserved = (self.pin_cap_fraction + self.ledger_cap_fraction) * self.budget_tokens + self.tail_tokens
        if reserved + 2 * PAGE_TOKENS > self.low_watermark * self.budget_tokens:
            raise ValueError(
                f"pins ({self.pin_cap_fraction:.0%}), ledger ({self.ledger_cap_fraction:.0%}) and the tail "
                f"({self.tail_tokens} tokens) leave no room under the low watermark "
                f"of a {self.budget_tokens}-token budget")

    @property
    def high_tokens(self) -> int:
        return int(self.high_watermark * self.budget_tokens)

    @property
    def low_tokens(self) -> int:
        return int(self.low_watermark * self.budget_tokens)


@dataclass
class Page:
    index: int
    token_start: int
    token_end: int
    state: PageState = PageState.HOT
    pin: PinKind | None = None
    lease_until_turn: int = 0
    last_used_turn: int = 0
    stored: bool = False
    prefix_hash: str = ""   # PrefixChain's hash of every token id up to token_end, set by the pager
    stored_as: str = ""     # the id a store written before ids carried the prefix holds it under

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def resident(self) -> bool:
        return self.state is not PageState.COLD

    @property
    def page_id(self) -> str:
        """The id of this version of the page: its index, its length when it is partial, and
        its prefix hash. A page that grows, or is cut back and regrown with other tokens before
        or in it, gets another id, so each version is a record and a payload of its own: a store
        never replaces the payload of a version the last session record names (contextd
        deletes a replaced payload at once; the record that stops naming a version is written
        only at the end of the turn). Recovery keeps the id of a page a store written by an
        earlier version of kv-elision holds (`legacy_id`) in `stored_as` until the page changes."""
        if self.stored_as:
            return self.stored_as
        return f"{self.legacy_id}-{self.prefix_hash}"

    @property
    def legacy_id(self) -> str:
        """The id a page had before ids carried the prefix: its index, and its length when partial."""
        return f"p{self.index:07d}" if self.tokens == PAGE_TOKENS else f"p{self.index:07d}.{self.tokens}"


class PrefixChain:
    """xxh64 over token ids as int64s: page i's hash covers [0, 128 (i + 1)), so two histories
    share their first i + 1 pages exactly when their page-i hashes agree; `hash_to(n)` is the same
    hash over the first n ids, what a partial page's prefix hash is. Computed as tokens come: one
    running hasher fed every id, copied at each page's end, so a turn hashes only what it adds; a
    cut keeps the copies of the pages before it. The ids are kept (8 bytes a token) for a cut
    inside a page."""

    def __init__(self) -> None:
        self._ids = array("q")
        self._hashers: list[xxhash.xxh64] = []   # the running hasher at each full page's end
        self._open = xxhash.xxh64()              # ... after the last id
        self.hashes: list[str] = []   # one per full page, 16 hex digits each

    def extend(self, token_ids: Sequence[int]) -> PrefixChain:
        at = len(self._ids)
        self._ids.extend(token_ids)
        while at < len(self._ids):
            end = min(len(self._ids), (at // PAGE_TOKENS + 1) * PAGE_TOKENS)
            self._open.update(self._ids[at:end].tobytes())
            if end % PAGE_TOKENS == 0:
                self._hashers.append(self._open.copy())
                self.hashes.append(self._open.hexdigest())
            at = end
        return self

    def truncate(self, tokens: int) -> None:
        full = tokens // PAGE_TOKENS
        del self._ids[tokens:]
        del self._hashers[full:]
        del self.hashes[full:]
        self._open = self._hashers[-1].copy() if self._hashers else xxhash.xxh64()
        self._open.update(self._ids[full * PAGE_TOKENS:].tobytes())

    def hash_to(self, tokens: int) -> str:
        """The hash of the first `tokens` ids, where a page ends: a full page's end or the last id."""
        if tokens == len(self._ids):
            return self._open.hexdigest()
        if tokens % PAGE_TOKENS or not 0 < tokens < len(self._ids):
            raise ValueError(f"no page of {len(self._ids)} tokens ends at {tokens}")
        return self.hashes[tokens // PAGE_TOKENS - 1]


@dataclass
class Plan:
    """A selector's advice, in page indices."""

    restore: list[int] = field(default_factory=list)
    pin: list[int] = field(default_factory=list)
    evict_first: list[int] = field(default_factory=list)


@dataclass
class Decision:
    """What the engine must do now, in this order: evict, then restore."""

    evict: list[int]
    restore: list[int]
    plan_used: bool
    plan_rejected: str = ""


class Pager:
    """One session's pages. `append` grows the timeline; `decide` says what to move.

    Every state, pin and lease change goes through the pager's own methods, which keep the
    resident pages (a sorted list, never more than the budget's worth), the hot token count, the
    pinned and the leased pages in step: the checks made before every prefill chunk and every
    decoded token cost the same whatever the session's length (benchmarks.scale measures it)."""

    def __init__(self, config: PagerConfig) -> None:
        self.config = config
        self.pages: list[Page] = []
        self.turn = 0
        self.ledger: list[int] = []  # page indices of tool-call boundaries, oldest first
        self.plan_pins: set[int] = set()
        self.warnings: list[str] = []
        self._resident: list[int] = []      # sorted
        self._hot_tokens = 0
        self._pinned: dict[int, int] = {}   # hard-pinned page -> its tokens
        self._leased: dict[int, int] = {}   # page -> lease_until_turn
        self.chain = PrefixChain()

    # ------------------------------------------------------------------ timeline

    @property
    def total_tokens(self) -> int:
        return self.pages[-1].token_end if self.pages else 0

    @property
    def hot_tokens(self) -> int:
        return self._hot_tokens

    @property
    def resident(self) -> list[int]:
        """Indices of the pages in attention, ascending (read, never modify)."""
        return self._resident

    @property
    def pins(self) -> dict[int, PinKind]:
        """The hard-pinned pages and their kinds."""
        return {i: kind for i in self._pinned if (kind := self.pages[i].pin) is not None}

    def counts(self) -> dict[str, int]:
        """Pages by state, as contextd counts them: `hot` is every page in attention and `pinned`
        the hot pages with a hard pin (a part of `hot`)."""
        pinned = sum(1 for i in self._pinned if self.pages[i].resident)
        return {"hot": len(self._resident), "cold": len(self.pages) - len(self._resident), "pinned": pinned}

    def append(self, token_ids: Sequence[int], pin: PinKind | None = None) -> list[int]:
        """Add tokens at the end of the timeline; return the indices of pages that changed.

        With `pin`, every page the tokens touch is hard-pinned while the pin cap allows.
        """
        changed: list[int] = []
        self.chain.extend(token_ids)
        pos = 0
        size = PAGE_TOKENS
        while pos < len(token_ids):
            if not self.pages or self.pages[-1].tokens == size:
                start = self.total_tokens
                self.pages.append(Page(index=len(self.pages), token_start=start, token_end=start,
                                       last_used_turn=self.turn))
                self._resident.append(len(self.pages) - 1)
            page = self.pages[-1]
            take = min(size - page.tokens, len(token_ids) - pos)
            page.token_end += take
            page.stored = False  # its payload (if any) no longer covers the whole page
            page.prefix_hash, page.stored_as = self.chain.hash_to(page.token_end), ""
            if page.resident:
                self._hot_tokens += take
            if page.index in self._pinned:
                self._pinned[page.index] += take
            pos += take
            if pin is not None and page.pin is None:
                self._pin(page, pin)
            if not changed or changed[-1] != page.index:
                changed.append(page.index)
        return changed

    def truncate(self, tokens: int) -> list[int]:
        """Cut the timeline back to `tokens`; return indices of resident pages that lost tokens
        (whole or in part) so the engine can take those tokens out of attention."""
        if not 0 <= tokens <= self.total_tokens:
            raise ValueError(f"cannot truncate {self.total_tokens} tokens to {tokens}")
        touched = [i for i in self._resident if self.pages[i].token_end > tokens]
        self.chain.truncate(tokens)
        while self.pages and self.pages[-1].token_start >= tokens:
            self._forget(self.pages[-1])
            self.pages.pop()
        if self.pages and self.pages[-1].token_end > tokens:
            last = self.pages[-1]
            cut = last.token_end - tokens
            last.token_end = tokens
            last.stored = False
            last.prefix_hash, last.stored_as = self.chain.hash_to(tokens), ""
            self.lease(last.index, 0)   # the open page now: the tail keeps it, no lease does
            if last.resident:
                self._hot_tokens -= cut
            if last.index in self._pinned:
                self._pinned[last.index] -= cut
        self.ledger = [i for i in self.ledger if i < len(self.pages)]
        self.plan_pins = {i for i in self.plan_pins if i < len(self.pages)}
        return touched

    def _forget(self, page: Page) -> None:
        """Take a page that is being cut off the timeline out of the bookkeeping."""
        if page.resident:
            del self._resident[bisect.bisect_left(self._resident, page.index)]
            self._hot_tokens -= page.tokens
        self._pinned.pop(page.index, None)
        self._leased.pop(page.index, None)

    def _pin(self, page: Page, kind: PinKind) -> None:
        cap = int(self.config.pin_cap_fraction * self.config.budget_tokens)
        if sum(self._pinned.values()) + PAGE_TOKENS > cap:
            message = (f"hard pins would exceed {self.config.pin_cap_fraction:.0%} of the budget ({cap} tokens); "
                       f"page {page.index} ({kind.value}) stays evictable")
            log.warning(message)
            self.warnings.append(message)
            return
        page.pin = kind
        self._pinned[page.index] = page.tokens

    def mark_ledger(self, page_index: int) -> None:
        """Record a tool-call boundary on this page (kept in attention while the ledger cap allows)."""
        if self.ledger[-1:] != [page_index]:  # marks come in timeline order
            self.ledger.append(page_index)

    def recover(self, index: int, resident: bool, pin: PinKind | None, lease_until_turn: int,
                last_used_turn: int) -> None:
        """Set a recovered page's state, pin and lease as contextd holds them."""
        page = self.pages[index]
        page.last_used_turn = last_used_turn
        if page.resident != resident:
            self._set_state(index, PageState.HOT if resident else PageState.COLD)
        if pin is not None and page.pin is None:
            page.pin = pin
            self._pinned[index] = page.tokens
        self.lease(index, lease_until_turn)

    def _set_state(self, index: int, state: PageState) -> None:
        page = self.pages[index]
        was = page.resident
        page.state = state
        if was and not page.resident:
            del self._resident[bisect.bisect_left(self._resident, index)]
            self._hot_tokens -= page.tokens
        elif page.resident and not was:
            bisect.insort(self._resident, index)
            self._hot_tokens += page.tokens

    def lease(self, index: int, until_turn: int) -> None:
        """Page `index` is leased until `until_turn` (a turn already past: not leased). A restore
        leases through `apply`; an undo that puts a page back as it was sets its old lease here."""
        self.pages[index].lease_until_turn = until_turn
        if until_turn > self.turn:
            self._leased[index] = until_turn
        else:
            self._leased.pop(index, None)

    # ------------------------------------------------------------------ protections

    def _ledger_pinned(self) -> set[int]:
        cap = int(self.config.ledger_cap_fraction * self.config.budget_tokens)
        kept: set[int] = set()
        used = 0
        for index in reversed(self.ledger):
            page = self.pages[index]
            if page.pin is not None:
                continue
            if used + PAGE_TOKENS > cap:
                break
            kept.add(index)
            used += PAGE_TOKENS
        return kept

    def _tail(self) -> set[int]:
        """The open page plus the newest pages covering `tail_tokens`."""
        kept: set[int] = set()
        covered = 0
        for page in reversed(self.pages):
            if covered >= self.config.tail_tokens and page.tokens == PAGE_TOKENS:
                break
            kept.add(page.index)
            covered += page.tokens
        return kept

    def _hard_protected(self) -> set[int]:
        """What never leaves, leases and plan pins aside: hard pins, the ledger, the tail."""
        return set(self._pinned) | self._ledger_pinned() | self._tail()

    def protected(self) -> set[int]:
        """Everything the default retention must not evict now."""
        return self._hard_protected() | self.plan_pins | set(self._live_leases())

    def _live_leases(self) -> dict[int, int]:
        """The leases still running (page -> lease_until_turn); those run out are dropped here."""
        for index in [i for i, until in self._leased.items() if until <= self.turn]:
            del self._leased[index]
        return self._leased

    # ------------------------------------------------------------------ decisions

    def begin_turn(self) -> None:
        self.turn += 1

    def validate(self, plan: Plan) -> tuple[Plan, str]:
        """Drop unknown, duplicate and conflicting indices; reject a plan that breaks the budget.

        Returns the cleaned plan and a reason when the plan as a whole is rejected ("" if not).
        """
        known = range(len(self.pages))
        seen: set[int] = set()

        def clean(indices: Iterable[int]) -> list[int]:
            out = []
            for i in indices:
                if isinstance(i, int) and i in known and i not in seen:
                    seen.add(i)
                    out.append(i)
            return out

        pin = clean(plan.pin)
        restore = [i for i in clean(plan.restore) if self.pages[i].state is PageState.COLD]
        hard = set(self._pinned) | set(pin)
        evict_first = [i for i in clean(plan.evict_first) if i not in hard]
        cleaned = Plan(restore=restore, pin=pin, evict_first=evict_first)
        # Room the plan may fill: everything under the low watermark that protections do not hold.
        # A plan that brings nothing in (an eviction order alone) asks for no room.
        want = self._brought_in(cleaned)
        room = self.room(pin)
        if want > room:
            return Plan(), (f"plan asks for {want} tokens of restores and pins with room for {room} "
                            f"under the low watermark of {self.config.low_tokens}")
        return cleaned, ""

    def _brought_in(self, plan: Plan) -> int:
        """Tokens a cleaned plan brings into attention: its restores and its pins not in attention."""
        return sum(self.pages[i].tokens for i in plan.restore) + sum(
            self.pages[i].tokens for i in plan.pin if not self.pages[i].resident)

    def incoming_for(self, plan: Plan) -> int:
        """Tokens `plan` would bring into attention; 0 for a plan `validate` rejects."""
        cleaned, rejected = self.validate(plan)
        return 0 if rejected else self._brought_in(cleaned)

    def room(self, pin: Iterable[int] = ()) -> int:
        """Tokens that restores (and the pages `pin` names) may fill under the low watermark: what
        the protections leave, and never less than `lease_yield_tokens` of the room that pages
        restored on earlier turns hold. Their leases keep them from the default retention but
        yield that much to a new question: holding all of it, they left a question asked right
        after another no room and it brought nothing back (tests/server/test_selectors.py, seed
        1's boilerplate at a budget of 1,536: 0 pages back at 2 of the hybrid's 6 questions, at 3
        of the re-ranker's). Yielding all of it instead let every question fill the room, and
        the view's extra pages cost answers (`make demo`: the right value ranked first 4 of 8
        times against 8; docs/controller.md). `decide` evicts leased pages only once nothing
        unprotected is left."""
        kept = self._hard_protected() | self.plan_pins | set(pin)
        leases = self._live_leases()
        this_turn = self.restore_lease_until()
        restored_now = {i for i, until in leases.items() if until >= this_turn}
        return max(self._free(kept | set(leases)),
                   min(self.config.lease_yield_tokens, self._free(kept | restored_now)))

    def _free(self, kept: set[int]) -> int:
        """Tokens under the low watermark that the resident pages of `kept` leave."""
        return max(0, self.config.low_tokens - sum(self.pages[i].tokens for i in kept if self.pages[i].resident))

    def decide(self, plan: Plan | None = None, incoming_tokens: int = 0) -> Decision:
        """Pages to evict and restore so that attention plus `incoming_tokens` fits the budget.

        A valid plan's restores and pins are honoured and its eviction order goes first; an
        invalid plan is ignored whole (nothing is evicted because of it).
        """
        cleaned, rejected = self.validate(plan) if plan is not None else (Plan(), "")
        used = plan is not None and not rejected
        self.plan_pins = set(cleaned.pin) if used else set()
        restore = cleaned.restore + [i for i in cleaned.pin if not self.pages[i].resident] if used else []
        restore = sorted(set(restore))

        after_restore = self.hot_tokens + sum(self.pages[i].tokens for i in restore) + incoming_tokens
        evict: list[int] = []
        if after_restore > self.config.high_tokens:
            target = self.config.low_tokens
            order = (cleaned.evict_first if used else []) + list(self._resident)
            # Leases and plan pins yield only when nothing else is left: the budget always wins.
            for protected in (self.protected() | set(restore), self._hard_protected() | set(restore)):
                for index in order:
                    if after_restore <= target:
                        break
                    page = self.pages[index]
                    if index in evict or index in protected or not page.resident:
                        continue
                    evict.append(index)
                    after_restore -= page.tokens
        return Decision(evict=evict, restore=restore, plan_used=used, plan_rejected=rejected)

    def must_evict_for(self, incoming_tokens: int) -> bool:
        return self._hot_tokens + incoming_tokens > self.config.high_tokens

    def evictable(self) -> list[int]:
        """The pages in attention that nothing protects now, in the order the default retention
        evicts them (oldest first)."""
        protected = self.protected()
        return [index for index in self._resident if index not in protected]

    def unpinned_full(self) -> list[int]:
        """The full pages in attention without a hard pin, oldest first: the ones that are or may
        become evictable (the ledger, the tail and leases protect a page for a while only)."""
        return [index for index in self._resident
                if self.pages[index].pin is None and self.pages[index].tokens == PAGE_TOKENS]

    def pages_to_free(self, incoming_tokens: int, order: Sequence[int]) -> int:
        """How many of `order`'s pages, taken in turn, must leave for `incoming_tokens` more to
        fit (0 when they fit under the high watermark as it is)."""
        if not self.must_evict_for(incoming_tokens):
            return 0
        excess = self._hot_tokens + incoming_tokens - self.config.low_tokens
        for count, index in enumerate(order, start=1):
            excess -= self.pages[index].tokens
            if excess <= 0:
                return count
        return len(order)

    def apply(self, decision: Decision) -> None:
        """Record that the engine carried the decision out."""
        for index in decision.evict:
            page = self.pages[index]
            assert page.stored, f"page {index} left attention without a stored payload"
            self._set_state(index, PageState.COLD)
            page.last_used_turn = self.turn
        for index in decision.restore:
            page = self.pages[index]
            self._set_state(index, PageState.HOT)
            self.lease(index, self.restore_lease_until())
            page.last_used_turn = self.turn

    def restore_lease_until(self) -> int:
        """The turn until which a page restored now is leased (kept in attention)."""
        return self.turn + self.config.lease_turns

    def logical_start(self, index: int) -> int:
        """Where page `index` sits (or would sit) among the tokens held in attention: every
        resident page before it is full (only the timeline's last page can be partial)."""
        return PAGE_TOKENS * bisect.bisect_left(self._resident, index)
