"""Payloads found missing or damaged: a reader's report (ReportCorrupt) and `verify`'s re-read.

A page whose payload is lost is marked CORRUPT (contextd.pages) and never served again. With an
object store the folder is a cache, and a copy it lost or holds damaged is not a lost page: the
object store's copy is fetched back, checked, and the page is marked only when that one is lost
or damaged too (contextd.payloads). Its own module because it is the one place that decides
whether a payload is lost, for both the reader's word and contextd's own check.

Depends on contextd.pages, contextd.payloads, contextd.manifest, contextd.store, contextd.keys,
contextd.records, contextd.ids, contextd.errors and contextd.wire; no verb module depends on it.
"""

from __future__ import annotations

from contextd.errors import DataCorrupt
from contextd.ids import check_id
from contextd.keys import EVERYTHING, PageKey, session_scope
from contextd.manifest import session_row
from contextd.pages import Pages
from contextd.payloads import Payloads
from contextd.records import PageRef, VerifyResult
from contextd.store import MANIFEST, SNAPSHOTS, CommitInfo, Store
from contextd.wire import PageState


class Integrity:
    """ReportCorrupt and `verify` over `store`, marking pages through `pages`."""

    def __init__(self, store: Store, payloads: Payloads, pages: Pages) -> None:
        self.store = store
        self.payloads = payloads
        self.pages = pages

    def report_corrupt(self, session_id: str, page_id: str, reason: str) -> tuple[CommitInfo, int]:
        """A reader found a page's payload missing or failing its checks (ReportCorrupt); returns
        the commit and how many pages were marked CORRUPT. With an object store the folder is a
        cache: a copy it lost (evicted under the reader) or holds damaged is not a lost page. That
        copy goes and the object store's is fetched, checked; the page is marked only when that one
        is lost or damaged too, or when the folder's copy is whole (the reader's complaint is then
        about what the payload holds, such as other tokens than the page's)."""
        if self.payloads.tier is not None:
            with self.store.read() as txn:
                page = txn.get(MANIFEST, PageKey(session_id, check_id(page_id, "page_id")))
            if page is not None and page.locator and page.state != PageState.CORRUPT:
                wanted = (page.locator, page.byte_size, page.checksum)
                if self.payloads.damaged_in_folder(wanted):
                    lost = self.payloads.refetch(wanted)
                    if page.locator not in lost:
                        return CommitInfo(self.store.commit_seq, 0.0), 0
                    reason = f"{reason}; {lost[page.locator]}"
        return self.pages.mark_corrupt(session_id, page_id, reason), 1

    def verify(self, session_id: str) -> VerifyResult:
        """Re-read and re-checksum every stored payload; mark failures corrupt."""
        with self.store.read() as txn:
            if session_id:
                session_row(txn, session_id)
            scope = session_scope(session_id) if session_id else EVERYTHING
            pages = [(k.session_id, p) for k, p in txn.scan(MANIFEST, scope)
                     if p.locator and p.state != PageState.CORRUPT]
            snapshots = [(k.session_id, s) for k, s in txn.scan(SNAPSHOTS, scope) if s.locator]
        corrupt: list[PageRef] = []
        pages_ok = bytes_read = 0
        for sid, page in pages:
            try:
                self.payloads.check((page.locator, page.byte_size, page.checksum))
            except DataCorrupt as exc:
                self.pages.mark_corrupt(sid, page.page_id, str(exc))
                corrupt.append(PageRef(sid, page.page_id))
                continue
            pages_ok += 1
            bytes_read += page.byte_size
        for sid, snap in snapshots:
            try:
                self.payloads.check((snap.locator, snap.byte_size, snap.checksum))
            except DataCorrupt:
                corrupt.append(PageRef(sid, f"snapshot:{snap.slot}"))
                continue
            bytes_read += snap.byte_size
        return VerifyResult(pages_checked=len(pages), pages_ok=pages_ok, corrupt=tuple(corrupt),
                            snapshots_checked=len(snapshots), bytes_read=bytes_read)
