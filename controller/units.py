"""Semantic units (~1,024 tokens, whole pages, closed at message boundaries) and clusters of 8.

Units are what the controller talks about: it never sees page indices or token positions, only
opaque IDs, salted per session so nothing about an ID says where it is or can be guessed. A unit
closes at the first page that ends a message once it holds `min_pages`, or at `max_pages` whatever
happens. Eight closed units make a cluster. Tensor-free; depends on controller.pager only.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import xxhash

from controller.pager import PAGE_TOKENS, Pager

MIN_UNIT_PAGES = 6      # 6-10 pages of 128: ~1,024 tokens, closed at a message boundary
MAX_UNIT_PAGES = 10
CLUSTER_UNITS = 8


@dataclass
class Unit:
    unit_id: str
    pages: list[int]
    cluster_id: str = ""
    summary: str = ""


@dataclass
class Cluster:
    cluster_id: str
    unit_ids: list[str] = field(default_factory=list)
    summary: str = ""

    @property
    def closed(self) -> bool:
        return len(self.unit_ids) == CLUSTER_UNITS


class UnitIndex:
    """The units and clusters of one session, grown as its pages fill."""

    def __init__(self, salt: str | None = None) -> None:
        self.salt = salt or secrets.token_hex(8)
        self.units: dict[str, Unit] = {}
        self.clusters: dict[str, Cluster] = {}
        self.order: list[str] = []          # unit ids, oldest first
        self._unit_of_page: dict[int, str] = {}
        self._open: list[int] = []          # full pages not yet in a unit
        self._seen = 0                      # pages before this one are in a unit or open

    def _id(self, kind: str, first_page: int) -> str:
        return f"{kind}{xxhash.xxh64_hexdigest(f'{self.salt}/{kind}/{first_page}'.encode())[:12]}"

    def update(self, pager: Pager, message_end_pages: set[int]) -> list[Unit]:
        """Assign newly full pages to units; return the units this closed."""
        full_pages = len(pager.pages) - (1 if pager.pages and pager.pages[-1].tokens < PAGE_TOKENS else 0)
        closed: list[Unit] = []
        for index in range(self._seen, full_pages):
            self._seen = index + 1
            self._open.append(index)
            ends_message = index in message_end_pages
            if (len(self._open) >= MIN_UNIT_PAGES and ends_message) or len(self._open) >= MAX_UNIT_PAGES:
                closed.append(self._close())
        return closed

    def _close(self) -> Unit:
        unit = Unit(self._id("u", self._open[0]), self._open)
        self._open = []
        cluster = self.clusters[self.order_clusters[-1]] if self.order and not self._last_cluster_closed() else None
        if cluster is None:
            cluster = Cluster(self._id("c", unit.pages[0]))
            self.clusters[cluster.cluster_id] = cluster
        cluster.unit_ids.append(unit.unit_id)
        unit.cluster_id = cluster.cluster_id
        self.units[unit.unit_id] = unit
        self.order.append(unit.unit_id)
        for page in unit.pages:
            self._unit_of_page[page] = unit.unit_id
        return unit

    def _last_cluster_closed(self) -> bool:
        return self.clusters[self.order_clusters[-1]].closed

    @property
    def order_clusters(self) -> list[str]:
        return list(self.clusters)

    def pages_of(self, unit_ids: list[str]) -> list[int]:
        return [p for u in unit_ids if u in self.units for p in self.units[u].pages]

    def truncate(self, pages: int) -> None:
        """Forget units that reach page `pages` or beyond (the timeline was cut back); their pages
        before the cut are assigned again by the next `update`."""
        for unit_id in [u for u in self.order if max(self.units[u].pages) >= pages]:
            unit = self.units.pop(unit_id)
            self._seen = min(self._seen, unit.pages[0])
            self.order.remove(unit_id)
            cluster = self.clusters[unit.cluster_id]
            cluster.unit_ids.remove(unit_id)
            if not cluster.unit_ids:
                del self.clusters[unit.cluster_id]
            for page in unit.pages:
                self._unit_of_page.pop(page, None)
        self._seen = min(self._seen, pages)
        self._open = [p for p in self._open if p < self._seen]
