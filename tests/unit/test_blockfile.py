"""The block container without a model: one checksum per file, verified reads, one layer's keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends import Block, BlockFormatError, LayerView
from backends.blockfile import checksum

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
    from backends import BlockStream

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
        whole = stream.finish()
    np.testing.assert_array_equal(whole.keys, blk.keys)
    np.testing.assert_array_equal(whole.values, blk.values)
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF
    path.write_bytes(bytes(broken))
    with pytest.raises(BlockFormatError):
        Block.read(path, checksum(data), len(data))


def test_a_read_order_lets_a_file_read_its_bulk_only_when_fewer_than_depth_before_it_still_read() -> None:
    import threading

    from backends.blockfile import ReadOrder

    order = ReadOrder(1)
    first, second = order.ticket(), order.ticket()
    stopped = threading.Event()
    turns: list[bool] = []
    waiter = threading.Thread(target=lambda: turns.append(order.wait_turn(second, stopped)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not turns  # the first file has not finished reading
    order.done(first)
    waiter.join(5)
    assert turns == [True]
    third, fourth = order.ticket(), order.ticket()
    order.done(third)  # out of order: the fourth still waits for the second
    late = threading.Thread(target=lambda: turns.append(order.wait_turn(fourth, stopped)))
    late.start()
    late.join(0.3)
    assert late.is_alive()
    stopped.set()
    order.wake()
    late.join(5)
    assert turns == [True, False]  # a closed reader stops waiting and reads nothing


def test_streams_opened_together_read_in_turn_and_a_bad_header_surfaces_at_first_use(tmp_path: Path) -> None:
    from backends import BlockMismatchError, BlockStream
    from backends.blockfile import ReadOrder
    from backends.protocol import CorruptPayloadError

    blk = block()
    data = b"".join(blk.pieces())
    paths = []
    for n in range(3):
        paths.append(tmp_path / f"page{n}.kv")
        paths[-1].write_bytes(data)
    order = ReadOrder(1)
    streams = [BlockStream(p, checksum(data), len(data), expect=VIEW, order=order) for p in paths]
    try:
        # Every header and the token ids arrive before any file is used; the first file closed
        # unread lets the others read on.
        for stream in reversed(streams):
            np.testing.assert_array_equal(stream.small("token_ids"), blk.token_ids)
        streams[0].close()
        for stream in streams[1:]:
            np.testing.assert_array_equal(stream.rows("keys", 0, 3), blk.keys)
            np.testing.assert_array_equal(stream.finish().values, blk.values)
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
