"""What the server shows of its sessions as JSON: /v1/kv/stats and /v1/kv/pages.

Read-only: these functions read the engine's sessions and counters and change nothing. A page's
`state` is where its K/V are (hot: in attention, cold: only in the store); being pinned or
leased is said beside it (`pin`, `lease_until_turn`), not as a state of its own.

Depends on backends (the protocol) and serving.engine / session.
"""

from __future__ import annotations

from typing import Any

from backends import Backend
from serving.engine import Engine
from serving.heap import heap_figures


def kv_bytes_per_token(backend: Backend) -> int:
    """Attention K/V resident per held token: rotated keys, canonical rotary keys, values."""
    view = backend.layer_view
    itemsize = 4 if view.dtype == "float32" else 2
    return len(view.attention_layers) * view.num_kv_heads * (
        view.head_dim + view.rotary_dim + view.value_head_dim) * itemsize


def page_listing(engine: Engine, session_id: str, text: bool = False) -> dict[str, Any]:
    """Every page of a session: where it is and why. With `text`, the decoded text of each page
    (the user's own data: the server only offers it on loopback). KeyError for an unknown session."""
    session = engine.sessions[session_id]
    pager = session.pager
    ids = session.transcript.ids
    pins = pager.pins
    listed = []
    for page in pager.pages:
        entry: dict[str, Any] = {
            "index": page.index, "page_id": page.page_id, "state": page.state.name.lower(),
            "pin": pins[page.index].value if page.index in pins else None,
            "lease_until_turn": page.lease_until_turn if page.lease_until_turn > pager.turn else None,
            "token_start": page.token_start, "token_end": page.token_end,
            "moved_turn": page.last_used_turn, "stored": page.stored,
            "score": round(session.restore_scores[page.index], 4) if page.index in session.restore_scores else None}
        if text:
            entry["text"] = engine.format.decode(ids[page.token_start:page.token_end])
        listed.append(entry)
    return {"session_id": session_id, "turn": pager.turn, "budget_tokens": engine.config.budget_tokens,
            "restored_this_turn": session.counters.restored_pages_turn,
            "evicted_this_turn": session.counters.evicted_pages_turn,
            "last_selection": session.last_selection, "pages": listed}


def stats(engine: Engine, session_id: str | None) -> dict[str, Any]:
    """Counters, page counts and budget of one session, or the server's totals. KeyError for an
    unknown session."""
    backend = engine.backend
    if session_id is None:
        return {"counters": engine.totals.as_dict(), "sessions": sorted(engine.sessions),
                "budget_tokens": engine.config.budget_tokens, "active_session": engine.active,
                "resident_sessions": engine.sessions.residents,
                "sessions_left_memory": engine.sessions.dropped,
                "attention_tokens": backend.attention_tokens, "kv_bytes_per_token": kv_bytes_per_token(backend),
                "heap": heap_figures()}
    session = engine.sessions[session_id]
    pager = session.pager
    key_index, lexical_index = session.key_index, session.lexical_index
    return {"session_id": session_id, "counters": session.counters.as_dict(), "pages": pager.counts(),
            "session_tokens": session.transcript.tokens, "hot_tokens": pager.hot_tokens,
            "turn_phase": turn.phase.value if (turn := engine.sessions.turn(session_id)) else None,
            "budget_tokens": engine.config.budget_tokens, "turn": pager.turn,
            "attention_tokens": backend.attention_tokens if engine.active == session_id else pager.hot_tokens,
            "fingerprint": session.transcript.fingerprint.combined(),
            "kv_bytes_per_token": kv_bytes_per_token(backend), "last_selection": session.last_selection,
            "recovery_notes": session.recovery_notes,
            "last_turn": session.last_turn.as_dict() if session.last_turn else None,
            "read_ahead_ms": round(session.read_ahead_ms, 2),
            "key_index_pages": len(key_index.pages) if key_index else 0,
            "key_index_bytes": key_index.nbytes if key_index else 0,
            "lexical_index_pages": len(lexical_index.pages) if lexical_index else 0,
            "lexical_index_bytes": lexical_index.nbytes if lexical_index else 0}
