"""A stored block on its way into a session: what the caller knows of the file (`StoredBlock`),
and its read as it streams (`BlockStream`).

A restore is about the disk's read of its files, not the read plus the insert: the runtime inserts
each layer group of a block as soon as it has arrived, and `BlockStream` gives it the block's
sections in its file's order (positions and token ids first, then keys and values layer by
layer), landed straight in the runtime's slots where it can, each file's checksum verified before
anything of it is committed. The reading itself is backends/section_reader.py's; this module
knows what a block file holds and turns the reader's errors into the protocol's.

Dependency rules: numpy, backends.blockfile / section_reader / blocks / errors only.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .blockfile import ContainerError
from .blocks import Block, LayerView
from .errors import BlockFormatError, CorruptPayloadError
from .section_reader import ReadQueue, SectionReader

__all__ = ["BlockStream", "StoredBlock"]


@dataclasses.dataclass(frozen=True)
class StoredBlock:
    """A stored block file to insert: where it is, what its manifest says it is, and where it goes
    (before the held token now at index `at`). With `token_ids`, a file holding other tokens is
    corrupt; with `position`, its tokens take the positions from there on exactly."""

    path: str | os.PathLike[str]
    at: int
    checksum: str
    size: int
    token_ids: np.ndarray | None = None
    position: int | None = None

    def check_tokens(self, held: np.ndarray) -> None:
        """Raise CorruptPayloadError when the file holds other tokens than `token_ids` (if given)."""
        if self.token_ids is not None and not np.array_equal(held, self.token_ids):
            raise CorruptPayloadError(f"{os.fspath(self.path)} holds other tokens than the transcript at that place")


class BlockStream:
    """A stored block file read on a background thread (backends.section_reader.SectionReader), so
    a runtime inserts the layers that have arrived while the rest still comes from disk. Opening
    only opens the file: the header arrives on the thread, and the first call that needs it
    checks it (a block of another view raises there). `finish()` verifies the checksum. Nothing
    read may be committed before `finish()` returns.

    Opened `landing`, `land` says where the keys and values go: straight into a runtime's slots
    (what was read before is copied over), or into the reader's buffer (`land(None, None)`),
    from where `rows` gives them."""

    _LANDING = frozenset({"keys", "values"})

    def __init__(self, path: str | os.PathLike[str], checksum: str, size: int, *,
                 expect: LayerView | None = None, queue: ReadQueue | None = None,
                 landing: bool = False, read_here: bool = False) -> None:
        try:
            self._reader = SectionReader(path, Block.MAGIC, checksum, size, queue,
                                         self._LANDING if landing else frozenset(), read_here)
        except ContainerError as e:
            raise CorruptPayloadError(str(e)) from None
        except FileNotFoundError:
            raise BlockFormatError(f"{os.fspath(path)} is missing") from None
        self._expect = expect
        self._view: LayerView | None = None

    def check(self) -> LayerView:
        """The block's layer view, once its header has arrived; raises unless the file is a kv
        block of the expected view (checked once)."""
        if self._view is None:
            try:
                header = self._reader.header
            except ContainerError as e:
                raise CorruptPayloadError(str(e)) from None
            if header.get("kind") != "kv-block":
                raise BlockFormatError(f"not a kv block (kind={header.get('kind')!r})")
            view = LayerView.from_dict(header.get("view", {}))
            if self._expect is not None:
                self._expect.require_same(view)
            missing = {"keys", "values", "positions", "token_ids"} - self._reader.sections.keys()
            if missing:
                raise BlockFormatError(f"block is missing sections {sorted(missing)}")
            self._view = view
        return self._view

    @property
    def n_tokens(self) -> int:
        self.check()
        return int(self._reader.sections["positions"].shape[0])

    def small(self, section: str) -> np.ndarray:
        """`positions` or `token_ids`, once they have arrived (they come first in the file)."""
        self.check()
        self._wait(section, None)
        return self._reader.array(section)

    def keys_land(self) -> bool:
        """Whether a runtime should land this file's keys in its slots: a read of it so far
        waited for the disk (it is not all in the page cache), or the inserting thread reads it
        itself (`read_here`, its header was in the page cache). Keys another core copied out of
        the page cache rotate slower than keys copied just before their rotation, in this CPU's
        cache, and that outweighed the saved copy on a file the read queue serves from the page
        cache (a warm SmolLM2 page on the server's path was slower landed than copied, while cold
        pages were faster landed). Keys the inserting thread reads land in its own cache, and
        landing them made warm restores faster. Values, never rotated, land from any file: the
        restoring thread no longer copies them, and warm restores got faster. All interleaved in
        one process: docs/journal/2026-11-29-restore-path.md ("Blocks land in the slots", "Asking
        contextd nothing first", "Keys land where the inserting thread reads them", "Figures moved
        out of code comments")."""
        return self._reader.from_disk or self._reader.pulled

    def land(self, keys: list[memoryview] | None, values: list[memoryview] | None) -> tuple[bool, bool]:
        """For a stream opened `landing`: read the keys and the values straight into these byte
        buffers (each list, joined, is where that section goes, in the block's layout); with None,
        or when the file stores them compressed, into the reader's buffer. Call once. Returns
        whether the keys and whether the values land in the buffers given."""
        self.check()
        sections = self._reader.sections
        if not all(sections[name].frames is None for name in self._LANDING):
            keys = values = None
        self._reader.land({name: bufs for name, bufs in (("keys", keys), ("values", values)) if bufs is not None})
        return keys is not None, values is not None

    def rows(self, section: str, start: int, stop: int) -> np.ndarray:
        """Rows (layers) [start, stop) of `keys` or `values` (not landed elsewhere), once they
        have arrived."""
        self.arrived(section, stop)
        try:
            return self._reader.rows(section, start, stop)
        except ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def arrived(self, section: str, rows: int) -> None:
        """Wait until the first `rows` rows (layers) of `keys` or `values` have been read."""
        self.check()
        self._wait(section, rows)

    def _wait(self, section: str, rows: int | None) -> None:
        try:
            self._reader.wait(section, rows)
        except ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def finish(self) -> None:
        """Wait for the whole file and verify its checksum."""
        self.check()
        try:
            self._reader.finish()
        except ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> BlockStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
