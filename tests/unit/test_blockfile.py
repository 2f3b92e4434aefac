"""The block container without a model: one checksum per file, verified reads, one layer's keys."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends import Block, BlockFormatError, BlockStream, LayerView
from backends.blockfile import ContainerError, checksum
from backends.section_reader import ReadQueue
from harness.waits import wait_until

VIEW = LayerView(model_id="m", family="llama", attention_layers=(0, 1, 2), num_kv_heads=2, head_dim=8,
                 value_head_dim=8, rotary_dim=8, rope_layout="neox", dtype="float32")


def block() -> Block:
    rng = np.random.default_rng(0)
    return Block(view=VIEW, keys=rng.standard_normal((3, 2, 128, 8)).astype("<f4"),
                 values=rng.standard_normal((3, 2, 128, 8)).astype("<f4"),
                 positions=np.arange(256, 384, dtype=np.int64), token_ids=np.arange(128, dtype=np.int32))


def test_a_stored_block_reads_back_whole_or_one_layer_and_a_flipped_byte_is_caught(tmp_path: Path) -> None:
    blk = block()
    data = b"".join(blk.pieces())
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    back = Block.read(path, checksum(data), len(data), expect=VIEW)
    np.testing.assert_array_equal(back.keys, blk.keys)
    for layer in range(3):
        np.testing.assert_array_equal(Block.read_layer_keys(path, layer), blk.keys[layer])
    with pytest.raises(BlockFormatError, match="outside"):
        Block.read_layer_keys(path, 3)
    flipped = bytearray(data)
    flipped[-7] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(BlockFormatError, match="checksum"):
        Block.read(path, checksum(data), len(data))
    with pytest.raises(BlockFormatError, match="manifest says"):
        Block.read(path, checksum(data), len(data) - 1)


def test_a_compressed_block_round_trips_exactly_whole_by_layer_and_streamed(tmp_path: Path) -> None:

    blk = block()
    data = b"".join(blk.pieces(compress=True))
    assert len(data) != len(blk.to_bytes())
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    back = Block.read(path, checksum(data), len(data), expect=VIEW)
    for name in ("keys", "values", "positions", "token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(blk, name))
    for layer in range(3):
        np.testing.assert_array_equal(Block.read_layer_keys(path, layer), blk.keys[layer])
    with BlockStream(path, checksum(data), len(data), expect=VIEW) as stream:
        np.testing.assert_array_equal(stream.small("token_ids"), blk.token_ids)
        np.testing.assert_array_equal(stream.rows("keys", 0, 2), blk.keys[0:2])
        np.testing.assert_array_equal(stream.rows("keys", 2, 3), blk.keys[2:3])
        np.testing.assert_array_equal(stream.rows("values", 0, 3), blk.values)
        stream.finish()
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF
    path.write_bytes(bytes(broken))
    with pytest.raises(BlockFormatError):
        Block.read(path, checksum(data), len(data))


def test_a_read_queue_reads_every_header_first_then_each_file_whole_in_the_order_opened(tmp_path: Path) -> None:
    from backends.section_reader import SectionReader

    data = b"".join(block().pieces())
    events: list[tuple[str, str]] = []

    class Logged(SectionReader):
        name = ""

        def _read_head(self) -> bool:
            events.append(("head", self.name))
            return super()._read_head()

        def _read_bulk(self) -> None:
            events.append(("bulk", self.name))
            super()._read_bulk()

    def opened(name: str, queue: ReadQueue) -> Logged:
        path = tmp_path / f"{name}.kv"
        path.write_bytes(data)
        reader = Logged(path, Block.MAGIC, checksum(data), len(data), queue)
        reader.name = name
        return reader

    queue = ReadQueue(1)
    with queue._cond:  # the worker waits until every file is queued
        readers = [opened(name, queue) for name in "abc"]
        late = opened("closed", queue)
        late.close()  # taken off the queue before a worker reached it: nothing is read
    try:
        for reader in readers:
            reader.finish()
    finally:
        for reader in readers:
            reader.close()
    assert events == [("head", n) for n in "abc"] + [("bulk", n) for n in "abc"]
    with pytest.raises(ContainerError, match="closed before it was read"):
        late.finish()


def test_a_lingering_read_queue_reads_one_insert_after_another_on_one_thread_then_ends(tmp_path: Path) -> None:
    import threading

    from backends.section_reader import SectionReader

    data = b"".join(block().pieces())
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    readers: list[int] = []

    class Logged(SectionReader):
        def _read_bulk(self) -> None:
            readers.append(threading.get_ident())
            super()._read_bulk()

    with pytest.raises(ValueError, match="negative"):
        ReadQueue(1, linger_s=-1.0)
    queue = ReadQueue(1, linger_s=0.2)
    for _ in range(3):   # one insert after another, each read whole before the next is opened
        with Logged(path, Block.MAGIC, checksum(data), len(data), queue) as reader:
            reader.finish()
    assert len(readers) == 3 and len(set(readers)) == 1
    wait_until(lambda: not any(t.ident == readers[0] for t in threading.enumerate()), 10.0,
               "the idle reader thread to end")
    with Logged(path, Block.MAGIC, checksum(data), len(data), queue) as reader:   # a new one starts
        reader.finish()
    assert len(readers) == 4


def opened_together(folder: Path, blk: Block, **kw: Any) -> tuple[bytes, list[Path], list[BlockStream]]:
    """Three files holding `blk`, opened as streams on one read queue: its bytes, the files, the streams."""
    data = b"".join(blk.pieces())
    paths = [folder / f"page{i}.kv" for i in range(3)]
    for path in paths:
        path.write_bytes(data)
    queue = ReadQueue(1)
    return data, paths, [BlockStream(p, checksum(data), len(data), queue=queue, **kw) for p in paths]


def test_streams_opened_together_read_in_turn_and_a_bad_header_surfaces_at_first_use(tmp_path: Path) -> None:
    from backends import BlockMismatchError
    from backends.errors import CorruptPayloadError

    blk = block()
    data, paths, streams = opened_together(tmp_path, blk, expect=VIEW)
    try:
        # Every header and the token ids arrive before any file is used; the first file closed
        # unread lets the others read on.
        for stream in reversed(streams):
            np.testing.assert_array_equal(stream.small("token_ids"), blk.token_ids)
        streams[0].close()
        for stream in streams[1:]:
            np.testing.assert_array_equal(stream.rows("keys", 0, 3), blk.keys)
            stream.finish()
            np.testing.assert_array_equal(stream.rows("values", 0, 3), blk.values)
    finally:
        for stream in streams:
            stream.close()
    garbage = tmp_path / "garbage.kv"
    garbage.write_bytes(bytes(len(data)))
    with BlockStream(garbage, checksum(data), len(data), expect=VIEW) as stream, \
            pytest.raises(CorruptPayloadError, match="magic"):
        stream.small("token_ids")
    other = LayerView(**{**VIEW.to_dict(), "attention_layers": (0, 1, 2), "model_id": "other"})
    with BlockStream(paths[1], checksum(data), len(data), expect=other) as stream, \
            pytest.raises(BlockMismatchError, match="model_id"):
        stream.rows("keys", 0, 1)


def big_block() -> Block:
    """A block larger than the reader's first request, so the keys and values are read after
    the header, where they can land (the small one arrives whole with its header)."""
    rng = np.random.default_rng(1)
    shape = (3, 2, 128, 96)
    view = LayerView(model_id="m", family="llama", attention_layers=(0, 1, 2), num_kv_heads=2, head_dim=96,
                     value_head_dim=96, rotary_dim=96, rope_layout="neox", dtype="float32")
    return Block(view=view, keys=rng.standard_normal(shape).astype("<f4"),
                 values=rng.standard_normal(shape).astype("<f4"),
                 positions=np.arange(128, dtype=np.int64), token_ids=np.arange(128, dtype=np.int32))


def test_landed_keys_and_values_arrive_in_the_callers_buffers_checked_by_the_files_checksum(tmp_path: Path) -> None:
    from backends.blockfile import IO_CHUNK_BYTES
    from backends.errors import CorruptPayloadError

    blk = big_block()
    assert blk.keys.nbytes > IO_CHUNK_BYTES
    data, paths, streams = opened_together(tmp_path, blk, landing=True)
    try:
        # Every header first, the last file's before the first's; the first file is read whole
        # into the reader's buffer before it lands (land copies it over), the others land as read.
        for stream in reversed(streams):
            np.testing.assert_array_equal(stream.small("token_ids"), blk.token_ids)
        streams[0].arrived("values", 3)
        with pytest.raises(RuntimeError, match="caller's buffers"):
            streams[0].rows("keys", 0, 1)
        keys = [np.full_like(blk.keys, np.nan) for _ in streams]
        values = [np.full_like(blk.values, np.nan) for _ in streams]
        # One buffer a layer for the keys, the values whole: the section is split where it lands;
        # the third file lands its values only, its keys stay in the reader's buffer.
        assert streams[0].land([k.data for k in keys[0]], [values[0].data]) == (True, True)
        assert streams[1].land([keys[1].data], [v.data for v in values[1]]) == (True, True)
        assert streams[2].land(None, [values[2].data]) == (False, True)
        for stream in streams:
            stream.finish()
        for k, v in zip(keys[:2], values[:2], strict=True):
            np.testing.assert_array_equal(k, blk.keys)
            np.testing.assert_array_equal(v, blk.values)
        np.testing.assert_array_equal(values[2], blk.values)
        assert np.isnan(keys[2]).all()
        with pytest.raises(RuntimeError, match="caller's buffers"):
            streams[0].rows("keys", 0, 1)
        with pytest.raises(RuntimeError, match="caller's buffers"):
            streams[2].rows("values", 0, 1)
        np.testing.assert_array_equal(streams[2].rows("keys", 0, 3), blk.keys)
    finally:
        for stream in streams:
            stream.close()

    flipped = bytearray(data)
    flipped[-len(blk.values.tobytes()) // 2] ^= 1   # inside the values, which land elsewhere
    paths[0].write_bytes(bytes(flipped))
    queue = ReadQueue(1)
    with BlockStream(paths[0], checksum(data), len(data), queue=queue, landing=True) as stream:
        assert stream.land([np.empty_like(blk.keys).data], [np.empty_like(blk.values).data]) == (True, True)
        with pytest.raises(CorruptPayloadError, match="checksum"):
            stream.finish()
    with BlockStream(paths[1], checksum(data), len(data), queue=queue, landing=True) as stream:
        with pytest.raises(ValueError, match="cannot land"):
            stream.land([np.empty(8, np.uint8).data], [np.empty_like(blk.values).data])


def test_a_file_the_page_cache_holds_is_read_by_the_thread_that_opened_it(tmp_path: Path) -> None:
    """`read_here`: a file just written (in the page cache) has its header read and checked
    before the stream is returned, and its bulk is read by the caller as it asks for it, straight
    to where it lands; no thread of the queue starts. The checksum is still checked by `finish`,
    a bad header still raises at first use, and a stream closed unread ends."""
    from backends.errors import CorruptPayloadError

    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("reads that never wait for the disk need RWF_NOWAIT (Linux)")
    blk = big_block()
    data = b"".join(blk.pieces())
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    queue = ReadQueue(1)
    with BlockStream(path, checksum(data), len(data), queue=queue, landing=True, read_here=True) as stream:
        np.testing.assert_array_equal(stream.small("token_ids"), blk.token_ids)
        assert stream.keys_land()   # read by this thread, out of the page cache
        keys, values = np.full_like(blk.keys, np.nan), np.full_like(blk.values, np.nan)
        assert stream.land([keys.data], [values.data]) == (True, True)
        stream.arrived("keys", 1)
        np.testing.assert_array_equal(keys[0], blk.keys[0])
        assert np.isnan(values).all()   # not asked for yet: not read
        stream.finish()
        np.testing.assert_array_equal(keys, blk.keys)
        np.testing.assert_array_equal(values, blk.values)
    flipped = bytearray(data)
    flipped[-100] ^= 1
    path.write_bytes(bytes(flipped))
    with BlockStream(path, checksum(data), len(data), queue=queue, read_here=True) as stream:
        np.testing.assert_array_equal(stream.rows("keys", 0, 3), blk.keys)
        with pytest.raises(CorruptPayloadError, match="checksum"):
            stream.finish()
    BlockStream(path, checksum(data), len(data), queue=queue, read_here=True).close()
    path.write_bytes(bytes(len(data)))
    with BlockStream(path, checksum(data), len(data), queue=queue, read_here=True) as stream, \
            pytest.raises(CorruptPayloadError, match="magic"):
        stream.small("token_ids")
    assert queue._running == 0


def test_a_reader_opened_for_landing_and_closed_before_land_ends(tmp_path: Path) -> None:

    blk = big_block()
    data = b"".join(blk.pieces())
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    for queue in (ReadQueue(1), None):
        stream = BlockStream(path, checksum(data), len(data), queue=queue, landing=True)
        np.testing.assert_array_equal(stream.small("positions"), blk.positions)
        stream.close()   # before land: the reader stops where it is, and nothing waits for land
    # Without a queue, on a thread of its own.
    with BlockStream(path, checksum(data), len(data), landing=True) as stream:
        keys = np.empty_like(blk.keys)
        assert stream.land([keys.data], [np.empty_like(blk.values).data]) == (True, True)
        stream.finish()
        np.testing.assert_array_equal(keys, blk.keys)


def test_the_buffers_for_a_byte_range_are_exactly_its_bytes_cut_only_at_its_ends_and_overlaps_are_found() -> None:
    from backends.section_reader import _Pieces

    rng = np.random.default_rng(3)
    for _ in range(200):
        sizes = rng.integers(0, 40, size=int(rng.integers(1, 12)))
        total = int(sizes.sum())
        if not total:
            continue
        file = rng.integers(0, 256, size=total, dtype=np.uint8)
        starts, buffers, at = [], [], 0
        for size in sizes:   # each piece a copy of its bytes, some empty
            starts.append(at)
            buffers.append(memoryview(file[at:at + int(size)].copy()).cast("B"))
            at += int(size)
        pieces = _Pieces(starts, buffers)
        start = int(rng.integers(0, total))
        end = int(rng.integers(start + 1, total + 1))
        got = pieces.between(start, end)
        assert b"".join(bytes(b) for b in got) == file[start:end].tobytes()
        assert all(len(b) for b in got)
        assert all(any(b is piece for piece in pieces.bufs) for b in got[1:-1]), "a piece inside the range was cut"
        some = _Pieces(starts[::2], buffers[::2])   # pieces with gaps between them, as landed sections are
        expected = [(o, b) for o, b in zip(starts[::2], buffers[::2], strict=True)
                    if len(b) and o < end and o + len(b) > start]
        assert [(o, bytes(b)) for o, b in some.overlapping(start, end)] == [(o, bytes(b)) for o, b in expected]


def test_a_reader_whose_thread_cannot_start_is_neither_queued_nor_left_open(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from backends.section_reader import SectionReader

    data = b"".join(block().pieces())
    path = tmp_path / "page.kv"
    path.write_bytes(data)

    def open_on_it() -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path))

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    queue = ReadQueue(workers=1)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    for reads in (queue, None):   # the queue's thread, or a thread of its own
        with pytest.raises(RuntimeError, match="can't start"):
            SectionReader(path, Block.MAGIC, checksum(data), len(data), reads)
        assert open_on_it() == 0, "the file was left open"
    monkeypatch.undo()
    assert queue._running == 0 and not queue._heads, "the reader was left queued for a thread that never started"
