"""Putting blocks into a session's free slots: the streaming, verified insert of stored block files
(a restore, the server's only one) and the insert of a block held in memory.

A restore is about the disk's read of its files, not the read plus the insert. The places come
first: the `at`s of a batch are planned on integers (`slots.plan_inserts`), so each block's keys
are rotated once, at their final positions, and each held key pushed along is re-anchored once.
Every file of a batch is opened at once and read by the session's read queue in the order the
copies need them, headers, positions and token ids first; a block's token ids are checked before
any of its keys is copied. Each block goes in layer group by layer group as its bytes arrive, keys
then values, landed straight in the slots where the store allows; it is committed (slots
occupied, logical order updated) only once its whole file has verified, and a file that fails is
left out with its error in its place while the others land as if it had never been asked for.

`SlotBackend` (backends/runtime.py) runs an `Inserts` inside its page operation and keeps the read
queue (`read_queue`); an `Inserts` is given the session's slot store, counters and position limit,
so this module never needs the session itself.

Dependency rules: numpy and backends.blocks / block_stream / errors / protocol / section_reader /
slot_store / slots; never a tensor library, never backends.runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from .block_stream import BlockStream, StoredBlock
from .blocks import Block, LayerView
from .errors import BlockFormatError
from .protocol import Counters
from .section_reader import ReadQueue
from .slot_store import Landing, SlotStore
from .slots import BatchPlan, plan_inserts

__all__ = ["INSERT_BATCH_BYTES", "READ_LINGER_S", "READ_THREADS", "Inserts", "read_queue"]


# The read buffers one `insert_block_files` batch holds at once: 32 SmolLM2 float32 pages (5.9 MB
# each) go in one batch; a long plan for a big model goes in several, each still read in parallel.
INSERT_BATCH_BYTES = 256 << 20
# Threads that read one insert's files, in the order they go in (`ReadQueue`). One kept
# ahead of the copies on this disk and beat two, and both beat a thread per file all reading at
# once (16 cold SmolLM2 pages, interleaved: docs/journal/2026-12-06-backends-long-form.md).
READ_THREADS = 1
# How long a backend's read thread waits for the next insert before it ends: long enough to span
# an agent's turns, so a turn's restores start no thread (`ReadQueue`).
READ_LINGER_S = 30.0


def read_queue() -> ReadQueue:
    """The read queue a session's inserts read their files on, one per session (a fork gets its own)."""
    return ReadQueue(READ_THREADS, READ_LINGER_S)


def _batches(files: Sequence[StoredBlock]) -> Iterator[list[int]]:
    """Indices of `files` in consecutive runs of at most INSERT_BATCH_BYTES (at least one file)."""
    run: list[int] = []
    total = 0
    for i, f in enumerate(files):
        if run and total + f.size > INSERT_BATCH_BYTES:
            yield run
            run, total = [], 0
        run.append(i)
        total += f.size
    if run:
        yield run


class _Rows(Protocol):
    """Where a block's layers come from while it is placed: a stored file being read
    (`BlockStream`) or a block already in memory (`_HeldBlock`)."""

    def keys_land(self) -> bool: ...

    def land(self, keys: list[memoryview] | None, values: list[memoryview] | None) -> tuple[bool, bool]: ...

    def rows(self, section: str, start: int, stop: int) -> np.ndarray: ...

    def arrived(self, section: str, rows: int) -> None: ...

    def small(self, section: str) -> np.ndarray: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class _HeldBlock:
    """A block in memory, read the way a stored file is. It never lands: its arrays are copied
    into the slots once either way."""

    def __init__(self, block: Block) -> None:
        self.block = block

    def keys_land(self) -> bool:
        return False

    def land(self, keys: list[memoryview] | None, values: list[memoryview] | None) -> tuple[bool, bool]:
        return False, False

    def rows(self, section: str, start: int, stop: int) -> np.ndarray:
        return self.block.keys[start:stop] if section == "keys" else self.block.values[start:stop]

    def arrived(self, section: str, rows: int) -> None:
        pass

    def small(self, section: str) -> np.ndarray:
        return self.block.positions if section == "positions" else self.block.token_ids

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Incoming:
    """One block to place: before the held token `at`, at `wanted` positions (exactly, or where
    they fit), its layers from `source`."""

    at: int
    wanted: np.ndarray
    exact: bool
    source: _Rows


def _wanted_positions(saved: np.ndarray, position: int | None) -> np.ndarray:
    """The block's own saved positions, or the run starting at `position`."""
    if position is None:
        return saved
    return np.arange(position, position + int(saved.shape[0]), dtype=np.int64)


class Inserts:
    """The inserts of one page operation into a session's slot store: placed by one batch plan
    each, counted in the session's counters, and kept under its position limit (a plan that would
    pass it compacts)."""

    def __init__(self, store: SlotStore, counters: Counters, position_limit: int) -> None:
        self.store = store
        self.counters = counters
        self.position_limit = position_limit

    def held(self, blk: Block, at: int, position: int | None) -> None:
        """Put `blk`, held in memory and of this session's view, before the held token at `at`: at
        its saved positions where they fit, or exactly from `position` on."""
        results: list[BlockFormatError | None] = [None]
        self._place({0: _Incoming(at, _wanted_positions(blk.positions, position), position is not None,
                                  _HeldBlock(blk))}, 0, results)

    def files(self, files: Sequence[StoredBlock], results: list[BlockFormatError | None], expect: LayerView,
              queue: ReadQueue, opened: Callable[[], object] | None) -> None:
        """Put the stored blocks `files` in, in batches of at most INSERT_BATCH_BYTES, read on
        `queue` and refused unless of view `expect`; `results[i]` gets the error of a file left
        out. `opened` is called once the first batch's files are open."""
        inserted = 0
        for chunk in _batches(files):
            inserted += self._batch(files, chunk, inserted, results, expect, queue, opened)
            opened = None

    def _batch(self, files: Sequence[StoredBlock], chunk: list[int], shift: int,
               results: list[BlockFormatError | None], expect: LayerView, queue: ReadQueue,
               opened: Callable[[], object] | None) -> int:
        """One batch of `files` (its `at`s moved on by the `shift` tokens inserted
        before it); returns the tokens inserted. Every file is opened at once, so their headers
        and token ids are read first; their bulk is read READ_THREADS files at a time, in the
        order they go in, ahead of the copies. Nothing becomes visible before every block that
        goes in has verified."""
        streams: dict[int, BlockStream] = {}
        try:
            for i in chunk:
                try:
                    streams[i] = BlockStream(files[i].path, files[i].checksum, files[i].size,
                                             expect=expect, queue=queue, landing=True,
                                             read_here=i == chunk[0])
                except BlockFormatError as e:
                    results[i] = e
            if opened is not None:
                opened()
            for i in list(streams):
                try:
                    files[i].check_tokens(streams[i].small("token_ids"))
                except BlockFormatError as e:
                    results[i] = e
                    streams.pop(i).close()
            return self._place({i: _Incoming(files[i].at, _wanted_positions(rd.small("positions"), files[i].position),
                                             files[i].position is not None, rd)
                                for i, rd in streams.items()}, shift, results)
        finally:
            for rd in streams.values():
                rd.close()

    def _place(self, incoming: dict[int, _Incoming], shift: int, results: list[BlockFormatError | None]) -> int:
        """Put blocks into free slots at the positions the batch plan gives them, layer group by
        layer group, keys first, then values (a streamed file is consumed in its on-disk order):
        landed there by the file's reader where the store allows (`SlotStore.landing`; then only
        the keys' rotation is left), keys only from a file read from the disk or by this thread
        (`BlockStream.keys_land`), else copied; verify each,
        then commit the ones that verified and re-anchor each held key at most once. Until the
        commit the slots stay free, so a failure leaves no trace beyond zeroed free slots. An
        exact block must take its wanted positions as they are (a recovery puts each page back
        where it was, so attention sees the same relative distances as before). Returns the
        tokens inserted; `results[i]` gets the error of a block that failed."""
        st = self.store

        def split(values: np.ndarray, ids: list[int]) -> dict[int, np.ndarray]:
            """`values` cut into consecutive pieces, one per block in `ids`, of its token count."""
            ends = np.cumsum([incoming[i].wanted.shape[0] for i in ids])
            return {i: values[end - incoming[i].wanted.shape[0]:end] for i, end in zip(ids, ends, strict=True)}

        def plan_for(ids: list[int]) -> tuple[BatchPlan, dict[int, np.ndarray]]:
            plan = plan_inserts(st.pos, st.order, [(incoming[i].at + shift, incoming[i].wanted, incoming[i].exact)
                                                   for i in ids], self.position_limit)
            fresh = plan.sources < 0
            return plan, split(plan.positions[fresh][np.argsort(-1 - plan.sources[fresh])], ids)

        live = sorted(incoming)
        if not live:
            return 0
        plan, placed = plan_for(live)
        slots = st.allocate(int(sum(incoming[i].wanted.shape[0] for i in live)))
        where = split(slots, live)
        token_ids: dict[int, np.ndarray] = {}
        try:
            # All told first: each reader then reads its bulk straight into the slots. Values land
            # wherever the store allows; keys only from a file read from the disk or by this thread
            # (BlockStream.keys_land).
            landings: dict[int, tuple[Landing, bool, bool]] = {}
            for i in live:
                landing = st.landing(where[i])
                if landing is not None:
                    keys_land = incoming[i].source.keys_land()
                    landed = incoming[i].source.land(landing.keys if keys_land else None, landing.values)
                    landings[i] = (landing, *landed)
                else:
                    incoming[i].source.land(None, None)
            for i in live:
                rd = incoming[i].source
                try:
                    groups = list(st.layer_groups(int(where[i].shape[0])))
                    landing, keys_landed, values_landed = landings.get(i, (None, False, False))
                    for a0, a1 in groups:
                        if keys_landed:
                            assert landing is not None
                            rd.arrived("keys", a1)
                            landing.rotate(a0, a1, placed[i])
                        else:
                            st.write_keys(where[i], a0, a1, rd.rows("keys", a0, a1), placed[i])
                    if not values_landed:
                        for a0, a1 in groups:
                            st.write_values(where[i], a0, a1, rd.rows("values", a0, a1))
                    rd.finish()
                    token_ids[i] = rd.small("token_ids")
                except BlockFormatError as e:
                    rd.close()  # its reader writes into the slots no more
                    st.clear(where[i])
                    results[i] = e
            if not token_ids:
                return 0
            kept = sorted(token_ids)
            if kept != live:
                # Placed as if the failed blocks had never been asked for: the survivors' keys are
                # rotated again where their positions moved.
                plan, moved_to = plan_for(kept)
                for i in kept:
                    if not np.array_equal(placed[i], moved_to[i]):
                        st.reanchor(where[i], moved_to[i])
                placed = moved_to
        except BaseException:
            for i in live:
                incoming[i].source.close()
            st.clear(slots)
            raise
        new_slots = np.concatenate([where[i] for i in kept])
        order = plan.sources.copy()
        fresh = order < 0
        order[fresh] = new_slots[-1 - order[fresh]]
        moved = ~fresh
        moved[~fresh] = st.pos[order[~fresh]] != plan.positions[~fresh]
        if moved.any():
            st.reanchor(order[moved], plan.positions[moved])
        st.occupied[new_slots] = True
        st.tokens[new_slots] = np.concatenate([token_ids[i] for i in kept])
        st.pos[new_slots] = np.concatenate([placed[i] for i in kept])
        st.order = order
        n = int(new_slots.shape[0])
        self.counters.restored_tokens += n
        self.counters.reanchored_keys += n + int(moved.sum())
        self.counters.compactions += plan.compactions
        return n
