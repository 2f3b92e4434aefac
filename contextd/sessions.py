"""Sessions as rows: open, look up, list, close, delete.

A session's row is made by OpenSession (or a branch, or an adoption) and removed with every other
row of the session by DeleteSession, whose payloads go only after the commit: a crash in between
leaves orphans for `gc`, never a manifest entry pointing at nothing. With an object store a
session's objects go only while this contextd holds it (contextd.holds decides).

Depends on contextd.holds (the only other verb module it may import: a hold decides whose objects
a delete removes), contextd.manifest, contextd.payloads, contextd.store, contextd.keys,
contextd.records, contextd.ids and contextd.errors; contextd.retention deletes idle sessions
through this one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from contextd.errors import InvalidArgument
from contextd.holds import Holds
from contextd.ids import check_id
from contextd.keys import EVERYTHING, SessionKey
from contextd.manifest import check_text, commit, remove_rows, session_row
from contextd.payloads import Payloads
from contextd.records import HoldRow, SessionRow
from contextd.store import HOLDS, SESSIONS, Store, Txn


class Sessions:
    """The session verbs over `store`."""

    def __init__(self, store: Store, payloads: Payloads, holds: Holds) -> None:
        self.store = store
        self.payloads = payloads
        self.holds = holds

    def open_session(self, session_id: str, model_id: str = "", fingerprint: str = "", budget_tokens: int = 0,
                     labels: Mapping[str, str] | None = None) -> SessionRow:
        key = SessionKey(check_id(session_id, "session_id"))
        check_text(fingerprint, "fingerprint", 256)
        check_text(model_id, "model_id", 512)
        labels = labels or {}
        if len(labels) > 64:
            raise InvalidArgument("at most 64 labels per session")

        def op(txn: Txn) -> SessionRow:
            now = time.time()
            session = txn.get(SESSIONS, key) or SessionRow(session_id, created_unix=now)
            session = replace(session, closed=False, model_id=model_id or session.model_id,
                              fingerprint=fingerprint or session.fingerprint,
                              budget_tokens=budget_tokens or session.budget_tokens,
                              labels={**session.labels, **labels}, updated_unix=now)
            txn.put(SESSIONS, key, session)
            return session

        return commit(self.store, op, "open the session")[0]

    def get_session(self, session_id: str) -> SessionRow:
        with self.store.read() as txn:
            return session_row(txn, session_id)

    def list_sessions(self, include_closed: bool) -> list[SessionRow]:
        with self.store.read() as txn:
            return [s for _, s in txn.scan(SESSIONS, EVERYTHING) if include_closed or not s.closed]

    def close_session(self, session_id: str) -> SessionRow:
        def op(txn: Txn) -> SessionRow:
            session = replace(session_row(txn, session_id), closed=True, updated_unix=time.time())
            txn.put(SESSIONS, SessionKey(session_id), session)
            return session

        return commit(self.store, op, "close the session")[0]

    def delete_session(self, session_id: str) -> tuple[int, int]:
        """Remove a session's rows, then its payloads. With an object store, its objects (payloads,
        holder, exported states) go only while this contextd holds it: a session another server
        took is that server's, and only this root's copy is deleted."""
        named: list[str] = []
        held: list[HoldRow] = []

        def op(txn: Txn) -> int:
            session_row(txn, session_id)
            if (hold := txn.get(HOLDS, SessionKey(session_id))) is not None:
                held.append(hold)
            pages, locators = remove_rows(txn, session_id)
            named.extend(locators)
            return pages

        pages, _ = commit(self.store, op, "delete the session")
        named.extend(self.payloads.take_unpublished(session_id))
        # Files go after the commit: a crash in between leaves orphans for `gc`, never a
        # manifest entry pointing at nothing.
        ours = self.holds.remove(session_id, held[0] if held else None)
        return pages, self.payloads.delete_session(session_id, named, ours)
