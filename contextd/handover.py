"""Sessions that move between servers sharing one object store, and the lease that keeps two
servers from serving one session at once.

Each session has a **holder** object in the object store (`sessions/ID/holder`, a small JSON map):
- `token`, the fencing token: one more at each change of hands;
- `node`, the contextd that holds the session (its root's node id, contextd.paths);
- `model_id`, the model the session's K/V belongs to (another model's server may not take it);
- `state`, the key of the state object its last committed turn exported ("" before the first);
- `busy_until`, while a turn is in progress, the wall-clock end of that turn's lease (0 between turns);
- `deleted`, on the holder a deleted session leaves behind (a tombstone, naming nothing).

Every change of the holder is a conditional PUT (If-Match the ETag read, If-None-Match for the
first), which the store applies atomically: of 8 writers racing with one ETag on Ceph 16's RGW,
exactly one won, every time. A loser re-reads and decides again. A PUT the store applied but whose
reply was lost is sent again and refused (412) by its own success: contextd.objects then reads the
holder back and takes a holder holding exactly its bytes as written. So:
- **claim** (a turn begins: HoldSession): the server that holds the token renews its lease; a
  holder whose lease has run out, or none, is taken over (the token goes up by one and the
  daemon replaces its rows of the session with the state the holder names: the session is
  *adopted*); a lease still running on another server is SessionHeld.
- **publish** (a turn commits: WriteRecord): the state (session row, record, manifest, pins,
  leases, snapshots) and any new transcript chunk go up under fresh keys, then one conditional
  PUT makes the holder name them and ends the lease. A holder changed since the claim means
  another server took the session: SessionHeld, and the new holder never reads what the stale
  one wrote, since no holder names it. That is the fencing: the token's holder is the only
  writer whose state anyone reads. A state object is deleted only while no holder names it.
- **remove** (the holder deletes the session): one more conditional PUT makes the holder a
  tombstone, and only then do the state and chunks go (and the daemon deletes the payloads).
  Of a delete and another server's claim racing, the store lets one win: a claim that lost
  finds the tombstone and starts the session afresh; a delete that lost leaves the session to
  the claimant, whose objects all stay. The holder object itself stays: not every S3 store
  honours a conditional DELETE (Ceph 16's RGW ignores If-Match there), and an unconditional one
  could remove a holder a claim had just written.

Transcript segments go up in chunks of CHUNK_SEGMENTS, and manifest rows in chunks of the pages
whose index // CHUNK_PAGES is the same, each named by its checksum, so a turn uploads only the
chunks it changed, not the whole transcript and manifest: the last transcript chunk, and the page
chunks holding the pages it appended, evicted or restored. A whole manifest is ~300 bytes a page
(2.4 MB at a million SmolLM2 tokens), which went up at every turn before. Payloads
are not this module's: the daemon deletes a payload object only after a publish stops naming
it, so an adopter finds every payload its state names.

Leases are wall-clock times: the servers' clocks must agree to well within a lease (NTP keeps
them within milliseconds; a lease is 30 s by default), read on the object store's clock (the
daemon's, contextd.clock, which a test moves). A server that stalls past its lease (a pause, a
partition) may find its session taken: its next write is refused, never merged.

Dependency rules: msgpack, xxhash, contextd.objects, contextd.errors; called by the daemon only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import msgpack
import xxhash

from contextd.errors import ContextdError, DataCorrupt, FailedPrecondition, SessionHeld
from contextd.objects import ConditionFailed, ObjectStore

__all__ = ["CHUNK_SEGMENTS", "Claim", "Exported", "Handover", "Holder", "payloads_named"]

CHUNK_SEGMENTS = 64     # transcript segments per chunk object: a Pi turn adds 2 to 10
CHUNK_PAGES = 64        # consecutive page indexes per manifest chunk object (~19 KB of rows)
CLAIM_ATTEMPTS = 8      # conditional writes lost in a row before a claim gives up (each loss is another server's win)
STATE_FORMAT = 2        # 1: the manifest's rows inline in the state object (still read)


def payloads_named(state: Mapping[str, Any]) -> set[str]:
    """The payload locators an exported state's pages and snapshots name."""
    return {row["locator"] for row in (*state["pages"], *state["snapshots"]) if row.get("locator")}


@dataclass(frozen=True)
class Holder:
    """The holder object of one session, and the ETag it was read or written with."""

    token: int
    node: str
    model_id: str = ""
    state: str = ""
    busy_until: float = 0.0
    etag: str = ""
    deleted: bool = False

    def pack(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "etag"}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, etag: str, key: str) -> Holder:
        try:
            fields = json.loads(data)
            return cls(token=int(fields["token"]), node=str(fields["node"]), model_id=str(fields["model_id"]),
                       state=str(fields["state"]), busy_until=float(fields["busy_until"]), etag=etag,
                       deleted=bool(fields.get("deleted", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataCorrupt(f"the holder object {key} is not one contextd wrote: {exc}") from None


@dataclass(frozen=True)
class Claim:
    """What a claim left: the holder as this server wrote it, and whether the session changed
    hands to this server (then its rows are to be replaced by the state `holder.state` names)."""

    holder: Holder
    adopted: bool
    previous_node: str   # the contextd that held it before ("" for a new session)


@dataclass(frozen=True)
class Exported:
    """A session's state as a publish put it up: the holder naming it and the transcript chunks."""

    holder: Holder
    chunks: tuple[str, ...]


class Handover:
    """The holder objects and exported states of the sessions in one object store."""

    def __init__(self, objects: ObjectStore, node: str) -> None:
        self.objects = objects
        self.node = node

    def _holder_key(self, session_id: str) -> str:
        return self.objects.session_key(session_id, "holder")

    def holder(self, session_id: str) -> Holder | None:
        key = self._holder_key(session_id)
        found = self.objects.read_object(key)
        return None if found is None else Holder.parse(found[0], found[1], key)

    def claim(self, session_id: str, token: int, model_id: str, lease_s: float, renew: bool = False) -> Claim:
        """Hold `session_id` for a turn of `lease_s` seconds. `token` is the one this server held
        (0: none). Raises SessionHeld while another server's lease runs (with `renew`: whenever
        this server does not hold `token`), FailedPrecondition when the session is another model's."""
        key = self._holder_key(session_id)
        for _ in range(CLAIM_ATTEMPTS):
            current = self.holder(session_id)
            now = self.objects.clock.time()
            try:
                if (current is None or current.deleted) and renew:
                    raise SessionHeld(f"session {session_id} was deleted by another server")
                if current is None or current.deleted:
                    # A new session, or one deleted (elsewhere, this server's copy is then stale: adopted, empty).
                    fresh = Holder(max(token, current.token if current else 0) + 1, self.node, model_id, "",
                                   now + lease_s)
                    etag = self.objects.write_object(key, fresh.pack(), absent=True) if current is None else \
                        self.objects.write_object(key, fresh.pack(), match=current.etag)
                    return Claim(replace(fresh, etag=etag), adopted=token > 0, previous_node="")
                if model_id and current.model_id and current.model_id != model_id:
                    raise FailedPrecondition(f"session {session_id} holds K/V of model {current.model_id}; "
                                             f"this server serves {model_id}")
                ours = current.node == self.node and current.token == token
                if renew and not ours:
                    raise SessionHeld(f"session {session_id} was taken over by {current.node} (token "
                                      f"{current.token}; this server held {token})")
                if not ours and current.node != self.node and current.busy_until > now:
                    raise SessionHeld(f"session {session_id} is serving a turn on {current.node} (its lease runs "
                                      f"{current.busy_until - now:.0f} s more); send the request again then")
                taken = replace(current, token=current.token if ours else current.token + 1, node=self.node,
                                model_id=current.model_id or model_id, busy_until=now + lease_s)
                etag = self.objects.write_object(key, taken.pack(), match=current.etag)
                return Claim(replace(taken, etag=etag), adopted=not ours, previous_node=current.node)
            except ConditionFailed:
                continue
        raise SessionHeld(f"session {session_id} changed hands {CLAIM_ATTEMPTS} times while this server tried "
                          "to take it; send the request again")

    def publish(self, session_id: str, held: Holder, chunks_before: Sequence[str], state: dict[str, Any],
                segments: Sequence[dict[str, Any]]) -> Exported:
        """Put up a committed turn's state and make the holder name it, ending the lease. `held`
        is the holder as this server last wrote it, `chunks_before` the chunks its state names.
        SessionHeld when another server took the session since: nothing this call wrote is named."""
        before = set(chunks_before)
        groups: dict[int, list[Any]] = {}
        for row in state["pages"]:
            groups.setdefault(int(row.get("index", 0)) // CHUNK_PAGES, []).append(row)
        segment_chunks = self._put_chunks(session_id, "segments", before, [
            list(segments[start:start + CHUNK_SEGMENTS]) for start in range(0, len(segments), CHUNK_SEGMENTS)])
        page_chunks = self._put_chunks(session_id, "pages", before, [groups[g] for g in sorted(groups)])
        chunks = [*segment_chunks, *page_chunks]
        state_key = self.objects.session_key(session_id, f"state/{held.token:012d}-{uuid.uuid4().hex[:12]}")
        exported = {k: v for k, v in state.items() if k != "pages"}
        self.objects.write_object(state_key, msgpack.packb(
            {"format": STATE_FORMAT, **exported, "chunks": segment_chunks, "page_chunks": page_chunks},
            use_bin_type=True))
        published = replace(held, state=state_key, busy_until=0.0)
        try:
            etag = self.objects.write_object(self._holder_key(session_id), published.pack(), match=held.etag)
        except ConditionFailed:
            now = self.holder(session_id)
            if now is None or now.state != state_key:
                # Not applied. No holder names the state object, and none will: each is made from
                # the one it replaces. Content-named chunks may be the new holder's too.
                self._discard([state_key])
                where = "it was deleted there" if now is None or now.deleted else \
                    f"{now.node} holds it with token {now.token}"
                raise SessionHeld(f"session {session_id} was taken over by another server ({where}; this server "
                                  f"held token {held.token}): this turn's write is refused") from None
            # Applied (its reply lost) and taken over since by a claim that kept naming its state:
            # the turn is exported. The ETag kept is one the holder no longer has, so nothing more
            # is written from it until a claim reads the holder again.
            etag = held.etag
        self._discard([held.state] * bool(held.state) + [c for c in chunks_before if c not in chunks])
        return Exported(replace(published, etag=etag), tuple(chunks))

    def _put_chunks(self, session_id: str, kind: str, present: set[str], chunks: Sequence[list[Any]]) -> list[str]:
        """Put up each chunk (a list of rows) that is not `present` already, under a key named by
        its checksum; the keys, in order."""
        keys: list[str] = []
        for rows in chunks:
            data = msgpack.packb(rows, use_bin_type=True)
            key = self.objects.session_key(session_id, f"{kind}/{xxhash.xxh3_128_hexdigest(data)}")
            if key not in present:
                self.objects.write_object(key, data)
            keys.append(key)
        return keys

    def _read_chunks(self, keys: Sequence[str], what: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for key in keys:
            got = self.objects.read_object(key)
            if got is None or xxhash.xxh3_128_hexdigest(got[0]) != key.rsplit("/", 1)[-1]:
                raise DataCorrupt(f"the {what} chunk {key} is missing or changed in the object store")
            rows.extend(msgpack.unpackb(got[0], raw=False, strict_map_key=False))
        return rows

    def _read_state(self, holder: Holder) -> dict[str, Any] | None:
        """The state object `holder` names with its manifest rows in `pages` (read from its page
        chunks) and every chunk it names in `chunks`; None before the first turn."""
        if not holder.state:
            return None
        found = self.objects.read_object(holder.state)
        if found is None:
            raise DataCorrupt(f"the session state {holder.state} the holder names is missing from the object store")
        try:
            state = msgpack.unpackb(found[0], raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise DataCorrupt(f"the session state {holder.state} is unreadable: {exc}") from None
        if not isinstance(state, dict) or state.get("format") not in (1, STATE_FORMAT):
            raise DataCorrupt(f"the session state {holder.state} is not of format 1 or {STATE_FORMAT}")
        if state["format"] == STATE_FORMAT:
            state["pages"] = self._read_chunks(state["page_chunks"], "manifest")
            state["chunks"] = [*state["chunks"], *state.pop("page_chunks")]
        return state

    def load(self, holder: Holder) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """The state `holder` names, with its manifest rows in `pages` and in `chunks` every chunk
        object it names, and its transcript segments (None before its first turn); DataCorrupt
        when an object is missing or not what its name says."""
        state = self._read_state(holder)
        if state is None:
            return None
        transcript = [key for key in state["chunks"] if key.rsplit("/", 2)[-2] == "segments"]
        return state, self._read_chunks(transcript, "transcript")

    def named(self, holder: Holder, session_id: str) -> set[str]:
        """Every object key `holder` names, directly or through its state: the holder itself, the
        state, its transcript and manifest chunks and the payloads of its pages and snapshots
        (what `gc` keeps). DataCorrupt when the state cannot be read whole: then nothing can
        tell which of the session's objects it names."""
        keys = {self._holder_key(session_id)}
        state = self._read_state(holder)
        if state is None:
            return keys
        payloads = {self.objects.key(locator) for locator in payloads_named(state)}
        return keys | {holder.state, *state["chunks"]} | payloads

    def remove(self, session_id: str, held: Holder, chunks: Sequence[str]) -> bool:
        """A deleted session's state and chunks, when this server still holds it (True); a session
        another server took, even while this call ran, is left to it (False). The holder becomes
        a tombstone first, by a conditional PUT over the holder as read: a claim racing the delete
        either wins (the PUT fails and nothing goes) or finds the tombstone."""
        current = self.holder(session_id)
        if current is None or current.deleted or current.token != held.token or current.node != self.node:
            return False
        tombstone = Holder(current.token + 1, self.node, current.model_id, deleted=True)
        try:
            self.objects.write_object(self._holder_key(session_id), tombstone.pack(), match=current.etag)
        except ConditionFailed:
            return False
        self._discard([*sorted({held.state, current.state} - {""}), *chunks])
        return True

    def _discard(self, keys: Sequence[str]) -> None:
        """Delete objects nobody names any more; a store that does not answer leaves orphans."""
        for key in keys:
            try:
                self.objects.delete_object(key)
            except ContextdError:
                continue
