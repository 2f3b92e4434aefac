"""One session's serving state in memory, and its counters.

A `Session` is what the engine and the page mover share for one client conversation: the
transcript (serving.transcript), the pager (controller.pager), the lexical and
model-native key indexes, the recurrent snapshots of a hybrid and the bookkeeping of what is in
contextd already. Its durable form is the manifest (page states, pins, leases: contextd is the
truth for where a page is) plus the session record (serving.paging writes both).

Depends on backends (RecurrentSnapshot), controller and serving.transcript / chat_format.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from backends import RecurrentSnapshot
from controller.eviction import AttentionOrder, EvictionAdvisor
from controller.keyindex import KeyIndex
from controller.lexical import LexicalIndex
from controller.pager import Pager
from serving.chat_format import RenderMemo
from serving.transcript import Transcript


@dataclass
class SessionCounters:
    """What the engine counts per session and per server. Tokens through the model:
    `model_forward_tokens == new_prefill_tokens + decoded_tokens + blend_forward_tokens` and
    `historical_forward_during_restore == 0`; `blend_forward_tokens` are held tokens recomputed in
    the current view before an answer (serving.blend), 0 with the blend off. The rest describe
    page traffic and decisions."""

    model_forward_tokens: int = 0
    new_prefill_tokens: int = 0
    decoded_tokens: int = 0
    historical_forward_during_restore: int = 0
    blend_forward_tokens: int = 0     # held tokens recomputed before an answer (serving.blend)
    controller_forward_tokens: int = 0  # scoring forwards and a controller model's page reads (never history)
    restored_pages: int = 0
    evicted_pages: int = 0
    peak_attention_tokens: int = 0
    reprefilled_tokens: int = 0
    rebuilds: int = 0
    tail_drops: int = 0
    recovered_pages: int = 0
    stored_pages: int = 0
    stored_bytes: int = 0
    reanchored_keys: int = 0
    compactions: int = 0
    fixed_point_resamples: int = 0
    turns: int = 0
    restored_pages_turn: int = 0
    evicted_pages_turn: int = 0
    plans_used: int = 0
    plans_rejected: int = 0
    selector_ms: int = 0
    cancelled_turns: int = 0
    session_switches: int = 0   # turns that found another session's cache in the backend
    branches: int = 0           # 1 for a session that started as a branch of a stored one
    branch_kept_tokens: int = 0  # tokens of the parent's history it kept, never prefilled
    batched_decode_tokens: int = 0  # decoded tokens whose forward also decoded other sessions' (Engine.decode_batch)
    adoptions: int = 0          # turns that took the session over from another server (contextd.handover)

    def add(self, **deltas: int) -> None:
        for name, n in deltas.items():
            setattr(self, name, getattr(self, name) + n)

    def peak(self, attention_tokens: int) -> None:
        self.peak_attention_tokens = max(self.peak_attention_tokens, attention_tokens)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> SessionCounters:
        """Counters recorded by this or an earlier version (unknown names are left out)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in values.items() if k in names})


@dataclass(frozen=True)
class TurnTimings:
    """Where one turn's time went. `overhead_ms` is everything that is not the model's forward
    passes (render, align, page decisions, selection, stores, restores, contextd calls): the part
    of the pause before an answer that kv-elision adds (benchmarks.scale tracks it over a session).
    It includes reading and parsing the request body, which the HTTP layer times before the turn."""

    total_ms: float
    forward_ms: float
    phases: dict[str, float]   # ms in each of PHASES (the turn's own forwards are in none; scoring forwards are)

    @property
    def overhead_ms(self) -> float:
        return self.total_ms - self.forward_ms

    def as_dict(self) -> dict[str, float]:
        return {"total_ms": round(self.total_ms, 2), "forward_ms": round(self.forward_ms, 2),
                "overhead_ms": round(self.overhead_ms, 2),
                **{f"{name}_ms": round(self.phases.get(name, 0.0), 2) for name in PHASES}}


# Where a turn's overhead goes: read and parse the request body (HTTP); bring the session into the
# backend (nothing when it is there; a switch from another session, a recovery or a branch
# otherwise); render, align and tokenize the request; the selector's decision; the eviction
# advice (--evict-order model: its scoring forwards); payload writes and their records; restores
# (reads, checks, inserts); the end-of-turn write-through.
PHASES = ("receive", "activate", "prepare", "select", "advise", "store", "restore", "persist")


@dataclass(frozen=True)
class LastAnswer:
    """The previous turn's greedy answer, to notice a fixed point (the same input, the same answer)."""

    turn: int
    prompt_ids: list[int]
    answer_ids: list[int]


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """Where a stored page's payload is and what it holds, as its manifest record says: the
    prefix hash is the history its K/V were computed after (a restore takes it only for a page
    whose transcript gives the same)."""

    locator: str
    checksum: str
    byte_size: int
    prefix_hash: str


@dataclass
class Persisted:
    """What contextd already holds of a session: serving.paging writes it as pages and records
    are stored, serving.recovery rebuilds it from contextd, nothing else changes it."""

    page_ids: dict[int, str] = field(default_factory=dict)     # page index -> id of its stored version
    superseded: list[tuple[int, str]] = field(default_factory=list)  # (page, stored version) to delete
    pins: set[str] = field(default_factory=set)                 # pinned page ids contextd holds
    segments: int = 0                                           # transcript segments in the session record
    resident_positions: dict[int, int] = field(default_factory=dict)  # page -> first RoPE position, at turn end
    # page id -> its payload, as this server wrote it or last read its record: a restore from here
    # skips asking contextd, and its commit holds only if the page is still COLD with that payload
    payloads: dict[str, StoredPayload] = field(default_factory=dict)


@dataclass
class Session:
    session_id: str
    transcript: Transcript
    pager: Pager
    key_index: KeyIndex | None = None          # stored full pages by their keys (attention selector)
    lexical_index: LexicalIndex | None = None  # stored full pages by their token ids (hybrid selector)
    counters: SessionCounters = field(default_factory=SessionCounters)
    snapshots: dict[int, RecurrentSnapshot] = field(default_factory=dict)  # tokens -> state (hybrids)
    persisted: Persisted = field(default_factory=Persisted)
    last_answer: LastAnswer | None = None
    last_selection: str = ""
    last_turn: TurnTimings | None = None
    phase_ms: dict[str, float] = field(default_factory=dict)   # this turn so far, by PHASES
    recovery_notes: list[str] = field(default_factory=list)    # what recovery found and fixed
    restore_scores: dict[int, float] = field(default_factory=dict)  # page -> score that last brought it back
    render_memo: RenderMemo | None = None   # the last request's render, for rendering only what the next adds
    unread_pages: list[int] = field(default_factory=list)  # full pages stored this turn, for a controller to read
    read_ahead_ms: float = 0.0  # the controller's reading of them after the last turn's answer was out
    eviction: EvictionAdvisor | None = None  # the model's eviction advice (--evict-order model), else the pager's order
    attention: AttentionOrder | None = None  # the attention order (--evict-order attention), else the pager's order

    def timed(self, phase: str, started: float) -> None:
        """Add the time since `started` (time.perf_counter) to this turn's `phase`."""
        self.phase_ms[phase] = self.phase_ms.get(phase, 0.0) + (time.perf_counter() - started) * 1e3


class Tally:
    """Counts into a session's counters and the server's totals at once."""

    def __init__(self) -> None:
        self.totals = SessionCounters()

    def count(self, session: Session, **deltas: int) -> None:
        session.counters.add(**deltas)
        self.totals.add(**deltas)

    def peak(self, session: Session, attention_tokens: int) -> None:
        session.counters.peak(attention_tokens)
        self.totals.peak(attention_tokens)
