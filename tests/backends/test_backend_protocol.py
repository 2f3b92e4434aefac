"""The protocol's contract: loading and refusal, the block format, session semantics, accounting."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest

from backends import (
    Backend,
    BackendError,
    BackendUnavailableError,
    Block,
    BlockFormatError,
    BlockMismatchError,
    BlockStream,
    CorruptPayloadError,
    RecurrentSnapshot,
    StoredBlock,
    UnsupportedModelError,
    load_backend,
)
from backends.blockfile import FORMAT_VERSION, checksum
from backends.runtime import SlotBackend
from backends.slot_store import SlotStore
from backends.torch import TorchBackend

from .conftest import Harness, Models

# The random mixes run on a dense, a hybrid and a sliding-window (with attention sinks) model.
TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-next", "tiny-gpt-oss"]


# -- loading -----------------------------------------------------------------------------------

def test_a_runtime_missing_a_hook_cannot_be_instantiated() -> None:
    """The runtime base's hooks are abstract: a runtime that forgets one fails at construction, not
    when the hook first runs."""
    hooks = {name: vars(TorchBackend)[name] for name in SlotBackend.__abstractmethods__}
    assert {"_forward", "_new_cache", "_page_op", "_read_recurrent", "_settle"} <= hooks.keys()
    for missing in hooks:
        runtime = type("Runtime", (SlotBackend,), {k: v for k, v in hooks.items() if k != missing})
        with pytest.raises(TypeError, match=f"abstract method.*{missing}"):
            runtime(None, "tiny-llama")
    assert not type("Runtime", (SlotBackend,), hooks).__abstractmethods__

    class Store(SlotStore):
        group_elements = 1 << 20

    with pytest.raises(TypeError, match="abstract method.*write_canon"):
        Store(None, 16)  # type: ignore[abstract, arg-type]


def test_backend_satisfies_protocol(models: Models) -> None:
    be = models.fresh("tiny-llama")
    assert isinstance(be, Backend)
    assert be.attention_tokens == 0 and be.stream_tokens == 0 and be.pending_token is None


def test_unknown_runtime_and_model_are_refused(backend_name: str, device: str) -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        load_backend("no-such-runtime", "tiny-llama")
    if importlib.util.find_spec("mlx") is None:
        with pytest.raises(BackendUnavailableError, match="mlx"):
            load_backend("mlx", "tiny-llama")
    with pytest.raises(UnsupportedModelError, match="unknown model"):
        load_backend(backend_name, "no-such-model", device=device)


def _hf_folder(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 100}, "gpt2"),
        ({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 100, "use_sliding_window": True,
          "sliding_window": 16, "max_window_layers": 0}, "sliding"),
        ({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 100,
          "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "dynamic"),
        ({"model_type": "deepseek_v3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "kv_lora_rank": 16, "q_lora_rank": 24, "vocab_size": 100}, "MLA"),
        ({"model_type": "bloom", "hidden_size": 32, "n_layer": 2, "n_head": 2, "vocab_size": 100}, "ALiBi"),
        ({"model_type": "llama4_text", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "attention_chunk_size": 64, "vocab_size": 100}, "chunked attention"),
        ({"model_type": "mistral", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 100, "sliding_window": 16},
         "no global-attention layer"),
    ],
)
def test_unsupported_models_name_what_is_missing(backend_name: str, device: str, tmp_path: Path,
                                                 config: dict[str, object], named: str) -> None:
    """Refused from the config and the modules, before any weight is read (these folders have none)."""
    with pytest.raises(UnsupportedModelError, match=named):
        load_backend(backend_name, _hf_folder(tmp_path, config), device=device)


def test_mlx_quantized_copies_load_natively_and_only_in_mlx(backend_name: str, models: Models) -> None:
    """A 4-bit folder made by mlx_lm.convert runs on mlx-lm's quantized layers (no dequantised copy);
    the torch backend refuses it and says where it runs."""
    if backend_name != "mlx":
        with pytest.raises(UnsupportedModelError, match="MLX-quantized"):
            load_backend(backend_name, "tiny-llama-q4")
        return
    import mlx.nn as nn

    be = models.fresh("tiny-llama-q4")
    attn = be.mlx_model.layers[0].self_attn  # type: ignore[attr-defined]
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert be.layer_view.dtype == "float32" and be.model_id != models.fresh("tiny-llama").model_id


# -- the block format --------------------------------------------------------------------------

def _block(models: Models, model: str = "tiny-llama") -> tuple[Backend, Block]:
    be = models.fresh(model)
    be.prefill(models.tokens[:300])
    return be, be.save_block(100, 228)


def test_block_round_trip_is_exact_and_laid_out_as_documented(models: Models) -> None:
    be, blk = _block(models, "tiny-qwen3-next")
    data = blk.to_bytes()
    magic, version, flags, hlen = struct.unpack_from("<8sHHI", data, 0)
    assert (magic, version, flags) == (b"KVEBLOCK", FORMAT_VERSION, 0)
    header = msgpack.unpackb(data[16:16 + hlen])
    payload = (16 + hlen + 63) // 64 * 64
    assert len(data) == payload + header["payload_len"]
    assert [s[0] for s in header["sections"]] == ["positions", "token_ids", "keys", "values"]
    offset = 0
    for name, dtype, shape, off, nbytes in header["sections"]:
        assert off == offset and off % 64 == 0
        raw = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=payload + off).reshape(shape)
        np.testing.assert_array_equal(raw, getattr(blk, name))
        offset = (off + nbytes + 63) // 64 * 64
    assert header["view"] == blk.view.to_dict() and header["n_tokens"] == 128
    back = Block.from_bytes(data, expect=be.layer_view)
    assert back.view == blk.view and back.model_name == "tiny-qwen3-next"
    for name in ("keys", "values", "positions", "token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(blk, name))
    np.testing.assert_array_equal(back.token_ids, np.asarray(models.tokens[100:228]))
    np.testing.assert_array_equal(back.positions, np.arange(100, 228))
    assert back.keys.shape == (1, 2, 128, 32) and back.nbytes == blk.nbytes


def _write(path: Path, data: bytes) -> tuple[str, int]:
    """A payload file as the canonical store writes it; its manifest checksum and size."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return checksum(data), len(data)


def test_block_and_snapshot_files_round_trip(models: Models, tmp_path: Path) -> None:
    be, blk = _block(models, "tiny-qwen3-next")
    path = tmp_path / "page.kvblock"
    digest, size = _write(path, blk.to_bytes())
    assert size == sum(len(p) for p in blk.pieces())
    back = Block.read(path, digest, size, expect=be.layer_view)
    np.testing.assert_array_equal(back.keys, blk.keys)
    np.testing.assert_array_equal(back.values, blk.values)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFormatError, match="checksum"):
        Block.read(path, digest, size)
    with pytest.raises(BlockFormatError, match="manifest says"):
        Block.read(path, digest, size + 1)
    with pytest.raises(BlockFormatError, match="missing"):
        Block.read(tmp_path / "gone", digest, size)
    snap = be.snapshot_recurrent()
    assert snap is not None
    snap_digest, snap_size = _write(tmp_path / "state.rs", snap.to_bytes())
    assert RecurrentSnapshot.read(tmp_path / "state.rs", snap_digest, snap_size).equals(snap)


def _drop_from_page_cache(path: Path, cold: bool) -> None:
    """With `cold`, make the next read come from the disk (a streaming reader's slow path)."""
    if cold and hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_file_restore_equals_insert_and_refuses_corruption(models: Models, tmp_path: Path, cold: bool) -> None:
    be = models.fresh("tiny-qwen3")
    be.prefill(models.tokens[:700])
    ref = be.fork()
    path = tmp_path / "page.kvblock"
    saved = be.save_block(256, 384)
    digest, size = _write(path, saved.to_bytes())
    be.remove_attention_range(256, 384)
    be.compact_positions()
    twin = be.fork()
    twin.insert_block(Block.read(path, digest, size, expect=twin.layer_view), 256)
    _drop_from_page_cache(path, cold)
    be.insert_block_file(path, 256, checksum=digest, size=size, token_ids=saved.token_ids)
    back = be.save_block(256, 384)
    np.testing.assert_array_equal(back.keys, saved.keys)
    np.testing.assert_array_equal(back.values, saved.values)
    np.testing.assert_array_equal(be.rotated_keys(), twin.rotated_keys())
    np.testing.assert_array_equal(be.rotated_keys(), ref.rotated_keys())
    assert be.counters == twin.counters

    be.remove_attention_range(256, 384)
    before = be.fork()
    with pytest.raises(CorruptPayloadError, match="other tokens"):
        be.insert_block_file(path, 256, checksum=digest, size=size, token_ids=saved.token_ids[::-1].copy())
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    _write(path, bytes(data))
    _drop_from_page_cache(path, cold)
    with pytest.raises(CorruptPayloadError, match="checksum"):
        be.insert_block_file(path, 256, checksum=digest, size=size)
    assert be.attention_tokens == before.attention_tokens and be.counters == before.counters
    assert [be.decode() for _ in range(3)] == [before.decode() for _ in range(3)]
    with pytest.raises(BlockMismatchError):
        models.fresh("tiny-llama").insert_block_file(path, 0, checksum=digest, size=size)


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_many_files_in_one_call_equal_inserting_them_one_by_one(models: Models, tmp_path: Path, cold: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Five pages spread over a compacted session come back in one `insert_block_files` call: the
    same order, positions, rotated keys and logits as inserting the blocks one at a time (where
    each pushed every later key), and each moved key re-anchored once. With one file corrupt, the
    others land as if it had never been asked for. On torch on the CPU the values land in the slots,
    and the keys of files read from the disk (cold) or by the inserting thread (the first file of
    a call whose header the page cache holds; `BlockStream.keys_land`)."""
    be = models.fresh("tiny-qwen3")
    be.prefill(models.tokens[:1000])
    pages = [(64 * i * 2 + 64, 64 * i * 2 + 128) for i in range(5)]  # 64, 192, 320, 448, 576 (+64)
    files = []
    for start, end in pages:
        block = be.save_block(start, end)
        path = tmp_path / f"{start}.kvblock"
        files.append((block, path, *_write(path, block.to_bytes())))
    for start, end in reversed(pages):
        be.remove_attention_range(start, end)
    be.compact_positions()
    held = be.attention_tokens
    ats = [start - 64 * i for i, (start, _) in enumerate(pages)]  # the places in the held order now
    one_by_one = be.fork()
    for i, (block, *_ignored) in enumerate(files):
        one_by_one.insert_block(block, ats[i] + 64 * i)
    batched = be.fork()
    before = batched.counters
    landed: list[tuple[bool, bool]] = []
    land = BlockStream.land

    def spy(stream: BlockStream, keys: list[memoryview] | None,
            values: list[memoryview] | None) -> tuple[bool, bool]:
        landed.append(land(stream, keys, values))
        return landed[-1]

    monkeypatch.setattr(BlockStream, "land", spy)
    for _, path, _, _ in files:
        _drop_from_page_cache(path, cold)
    if cold:
        # Which reads find a file out of the page cache is the kernel's business (a read right
        # after the drop sometimes finds it there still), so "cold" says so itself: every file
        # takes the path of one read from the disk.
        monkeypatch.setattr(BlockStream, "keys_land", lambda stream: True)
    opened: list[int] = []   # when the caller's hook ran: how many blocks had been told where to land
    results = batched.insert_block_files([StoredBlock(path, at, digest, size, block.token_ids)
                                          for at, (block, path, digest, size) in zip(ats, files, strict=True)],
                                         opened=lambda: opened.append(len(landed)))
    assert results == [None] * 5
    assert opened == [0]   # once, before anything was placed
    # Values land wherever the store allows (torch on the CPU); keys only from files read from the
    # disk or by this thread (the first, cached).
    lands = models.backend == "torch" and models.device == "cpu"
    assert landed == [(lands, lands)] + [(cold and lands, lands)] * 4
    np.testing.assert_array_equal(batched.positions(), one_by_one.positions())
    np.testing.assert_array_equal(batched.rotated_keys(), one_by_one.rotated_keys())
    assert batched.attention_tokens == one_by_one.attention_tokens == held + 5 * 64
    assert batched.counters.restored_tokens - before.restored_tokens == 5 * 64
    assert batched.counters.reanchored_keys - before.reanchored_keys <= batched.attention_tokens
    assert [batched.decode() for _ in range(3)] == [one_by_one.decode() for _ in range(3)]

    block, path, digest, size = files[2]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    _write(path, bytes(data))
    without = be.fork()
    for i in (0, 1, 3, 4):
        without.insert_block(files[i][0], ats[i] + 64 * (i - (i > 2)))
    partial = be.fork()
    for _, path, _, _ in files:
        _drop_from_page_cache(path, cold)
    results = partial.insert_block_files([StoredBlock(path, at, digest, size, block.token_ids)
                                          for at, (block, path, digest, size) in zip(ats, files, strict=True)])
    assert isinstance(results[2], CorruptPayloadError) and "checksum" in str(results[2])
    assert all(results[i] is None for i in (0, 1, 3, 4))
    np.testing.assert_array_equal(partial.positions(), without.positions())
    np.testing.assert_array_equal(partial.rotated_keys(), without.rotated_keys())
    assert [partial.decode() for _ in range(3)] == [without.decode() for _ in range(3)]
    nothing: list[bool] = []
    assert partial.insert_block_files([], opened=lambda: nothing.append(True)) == []
    assert nothing == [True]


def test_corrupt_or_foreign_bytes_are_refused(models: Models) -> None:
    _, blk = _block(models)
    data = bytearray(blk.to_bytes())
    with pytest.raises(BlockFormatError):
        Block.from_bytes(bytes(data[:-1]))
    with pytest.raises(BlockFormatError, match="magic"):
        Block.from_bytes(b"NOTABLOCK" + bytes(data[9:]))
    newer = bytearray(data)
    struct.pack_into("<H", newer, 8, FORMAT_VERSION + 1)
    with pytest.raises(BlockFormatError, match="version"):
        Block.from_bytes(bytes(newer))


def test_block_from_another_model_is_refused(models: Models) -> None:
    _, blk = _block(models, "tiny-llama")
    other = models.fresh("tiny-qwen3")
    other.prefill(models.tokens[:200])
    with pytest.raises(BlockMismatchError, match="model_id"):
        other.insert_block(blk, 0)
    with pytest.raises(BlockMismatchError, match="model_id"):
        Block.from_bytes(blk.to_bytes(), expect=other.layer_view)
    assert other.attention_tokens == 200


def test_block_with_another_layer_view_is_refused(models: Models) -> None:
    be, blk = _block(models, "tiny-llama")
    fewer_layers = dataclasses.replace(blk.view, attention_layers=blk.view.attention_layers[:-1])
    forged = Block(view=fewer_layers, keys=blk.keys[:-1], values=blk.values[:-1], positions=blk.positions,
                   token_ids=blk.token_ids)
    with pytest.raises(BlockMismatchError, match="attention_layers"):
        be.insert_block(Block.from_bytes(forged.to_bytes()), 0)
    other_rotary = dataclasses.replace(blk.view, rotary_dim=blk.view.rotary_dim // 2)
    forged = dataclasses.replace(blk, view=other_rotary)
    with pytest.raises(BlockMismatchError, match="rotary_dim"):
        be.insert_block(forged, 0)


def test_block_with_another_dtype_is_refused(models: Models) -> None:
    half = models.fresh("tiny-llama", dtype="bfloat16")
    half.prefill(models.tokens[:200])
    blk = half.save_block(0, 128)
    assert blk.view.dtype == "bfloat16" and blk.keys.dtype == np.uint16
    full = models.fresh("tiny-llama")
    full.prefill(models.tokens[:200])
    with pytest.raises(BlockMismatchError, match="dtype"):
        full.insert_block(Block.from_bytes(blk.to_bytes()), 0)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_bfloat16_restore_is_bit_identical(models: Models, model: str) -> None:
    """In bf16 the re-anchoring uses the model's own bf16 arithmetic: keys come back bit for bit."""
    be = models.fresh(model, dtype="bfloat16")
    be.prefill(models.tokens[:512])
    ref = be.fork()
    blk = Block.from_bytes(be.save_block(128, 256).to_bytes(), expect=be.layer_view)
    be.remove_attention_range(128, 256)
    be.compact_positions()
    be.insert_block(blk, 128)
    np.testing.assert_array_equal(be.rotated_keys(), ref.rotated_keys())
    assert [be.decode() for _ in range(8)] == [ref.decode() for _ in range(8)]


# -- session semantics -------------------------------------------------------------------------

def test_fork_is_independent_and_reset_empties(models: Models) -> None:
    be = models.fresh("tiny-qwen3-next")
    be.prefill(models.tokens[:256])
    twin = be.fork()
    be.remove_attention_range(0, 128)
    be.prefill(models.tokens[256:300])
    assert twin.attention_tokens == 256 and twin.stream_tokens == 256
    assert be.attention_tokens == 172 and be.stream_tokens == 300
    assert twin.counters.new_prefill_tokens == 256
    be.reset()
    assert be.attention_tokens == 0 and be.stream_tokens == 0 and be.pending_token is None
    snap = be.snapshot_recurrent()
    assert snap is not None and not snap.states
    with pytest.raises(BackendError):
        be.decode()
    be.prefill(models.tokens[:256])
    assert [be.decode() for _ in range(4)] == [twin.decode() for _ in range(4)]


def test_a_session_field_fork_does_not_decide_fails_every_fork(models: Models) -> None:
    """A field added to a session and forgotten in `fork` would leave forks without it (or sharing
    it): the fork refuses instead."""
    be = models.fresh("tiny-llama")
    be._forgotten = []   # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="_forgotten"):
        be.fork()


def test_decode_feeds_pending_or_given_token_and_samples_reproducibly(models: Models) -> None:
    be = models.fresh("tiny-llama")
    logits = be.prefill(models.tokens[:64])
    first = be.decode()
    assert first == int(np.argmax(logits)) and be.pending_token == first
    assert be.counters.decoded_tokens == 0
    be.decode(token=7)
    assert be.held_token_ids()[-1] == 7 and be.counters.decoded_tokens == 1
    a, b = be.fork(), be.fork()
    sa = [a.decode(greedy=False, temperature=0.9, top_k=50, top_p=0.95, seed=11)] + [
        a.decode(greedy=False, temperature=0.9, top_k=50, top_p=0.95) for _ in range(7)]
    sb = [b.decode(greedy=False, temperature=0.9, top_k=50, top_p=0.95, seed=11)] + [
        b.decode(greedy=False, temperature=0.9, top_k=50, top_p=0.95) for _ in range(7)]
    assert sa == sb
    c = be.fork()
    sc = [c.decode(greedy=False, temperature=5.0, seed=12)] + [
        c.decode(greedy=False, temperature=5.0) for _ in range(7)]
    assert sc != sa
    before = be.attention_tokens
    be.prefill(models.tokens[64:70])
    # prefill appends exactly its tokens: the pending token is dropped, not fed.
    assert be.attention_tokens == before + 6 and be.pending_token is None


@pytest.mark.parametrize("model", TINY)
def test_extend_leaves_what_prefill_leaves_without_logits(models: Models, model: str) -> None:
    """`extend` is `prefill` without logits: the same keys, values, stream state and counters, bit
    for bit (MLX evaluates less of the same graph), and the forward after it gives the same logits.
    A prefill of several chunks, whose chunks but the last now have no logits, equals the same
    chunks prefilled one call each."""
    ids = models.tokens[:300]
    one, chunked = models.fresh(model, capacity=512), models.fresh(model, capacity=512, prefill_chunk=100)
    by_call, extended = models.fresh(model, capacity=512), models.fresh(model, capacity=512)
    one_logits = one.prefill(ids)
    chunked_logits = chunked.prefill(ids)
    for i in range(0, 300, 100):
        by_call_logits = by_call.prefill(ids[i:i + 100])
    np.testing.assert_array_equal(chunked_logits, by_call_logits)
    assert extended.extend(ids) is None
    for other in (chunked, extended):
        np.testing.assert_array_equal(other.rotated_keys(), (by_call if other is chunked else one).rotated_keys())
        np.testing.assert_array_equal(other.positions(), one.positions())
    assert dataclasses.replace(extended.counters, forward_ns=0) == dataclasses.replace(one.counters, forward_ns=0)
    snap, expected = extended.snapshot_recurrent(), one.snapshot_recurrent()
    assert (snap is None) == (expected is None)
    if snap is not None and expected is not None:
        assert snap.equals(expected)
    with pytest.raises(BackendError, match="no logits"):
        extended.last_logits()
    with pytest.raises(BackendError, match="needs a prefill"):
        extended.decode()
    np.testing.assert_array_equal(extended.prefill(models.tokens[300:310]), one.prefill(models.tokens[300:310]))
    assert [extended.decode() for _ in range(4)] == [one.decode() for _ in range(4)]
    assert one_logits.shape == chunked_logits.shape


def test_out_of_vocabulary_tokens_are_refused_before_the_model_runs(models: Models) -> None:
    be = models.fresh("tiny-llama")
    be.prefill(models.tokens[:32])
    for bad in (be.vocab_size, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            be.prefill([5, bad])
        with pytest.raises(ValueError, match="vocabulary"):
            be.decode(token=bad)
    assert be.attention_tokens == 32 and be.counters.model_forward_tokens == 32
    be.decode(token=5)


def test_a_failed_forward_poisons_the_session_until_reset(models: Models, harness: Harness) -> None:
    be = models.fresh("tiny-qwen3-next")
    be.prefill(models.tokens[:32])
    with harness.fail_next_forward(be), pytest.raises(RuntimeError, match="injected"):
        be.prefill(models.tokens[32:40])
    with pytest.raises(BackendError, match="reset"):
        be.decode(token=1)
    with pytest.raises(BackendError, match="reset"):
        be.save_block(0, 16)
    be.reset()
    be.prefill(models.tokens[:32])
    assert be.attention_tokens == 32


def test_ranges_are_checked(models: Models) -> None:
    be = models.fresh("tiny-llama")
    be.prefill(models.tokens[:100])
    for start, end in ((-1, 10), (10, 5), (90, 101), (5, 5)):
        with pytest.raises(IndexError):
            be.save_block(start, end)
        with pytest.raises(IndexError):
            be.remove_attention_range(start, end)
    blk = be.save_block(0, 10)
    with pytest.raises(IndexError):
        be.insert_block(blk, 101)
    with pytest.raises(ValueError):
        be.prefill([])


def test_head_and_tail_pages_restore_in_place(models: Models) -> None:
    be = models.fresh("tiny-qwen3")
    be.prefill(models.tokens[:512])
    ref = be.fork()
    head, tail = be.save_block(0, 128), be.save_block(384, 512)
    be.remove_attention_range(384, 512)
    be.remove_attention_range(0, 128)
    be.insert_block(head, 0)
    be.insert_block(tail, be.attention_tokens)
    np.testing.assert_array_equal(be.positions(), np.arange(512))
    np.testing.assert_array_equal(be.rotated_keys(), ref.rotated_keys())
    assert be.counters.reanchored_keys == 256


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_scoring_after_blocks_equals_each_block_in_a_session_of_its_own(models: Models, model: str) -> None:
    """One forward scores the tokens after every block: each copy must read what a session holding
    only its block, at the same positions, reads (the slot groups keep the copies apart), and the
    scoring session's work touches nothing of the caller's."""
    be = models.fresh(model)
    be.prefill(models.tokens[:600])
    blocks = [be.save_block(0, 128), be.save_block(300, 428), be.save_block(500, 537)]
    question = models.tokens[700:712]
    before, keys, logits = be.counters, be.rotated_keys(), be.last_logits()
    scores, forwarded = be.score_after_blocks(blocks, question)
    assert scores.shape == (3, len(question) - 1) and forwarded == 3 * len(question)
    assert be.counters == before and be.attention_tokens == 600
    np.testing.assert_array_equal(be.rotated_keys(), keys)
    np.testing.assert_array_equal(be.last_logits(), logits)
    n, lead = len(question), 128
    for i, blk in enumerate(blocks):
        alone = models.fresh(model)
        alone.insert_block(blk, 0, position=lead + i * n - blk.n_tokens)
        steps = alone.prefill_logits(question)[:-1].astype(np.float64)
        steps -= steps.max(axis=1, keepdims=True)
        expected = steps[np.arange(n - 1), question[1:]] - np.log(np.exp(steps).sum(axis=1))
        np.testing.assert_allclose(scores[i], expected, atol=2e-4)
    assert np.abs(scores[0] - scores[1]).max() > 1e-3  # the blocks do make a difference
    # The scratch session is kept between calls: a second, smaller call reads nothing of the first.
    again, _ = be.score_after_blocks(blocks[2:], question[:6])
    alone = models.fresh(model)
    alone.insert_block(blocks[2], 0, position=0)
    steps = alone.prefill_logits(question[:6])[:-1].astype(np.float64)
    steps -= steps.max(axis=1, keepdims=True)
    expected = steps[np.arange(5), question[1:6]] - np.log(np.exp(steps).sum(axis=1))
    np.testing.assert_allclose(again[0], expected, atol=2e-4)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_scoring_with_a_sink_equals_a_session_holding_the_sink_then_the_block(models: Models, model: str) -> None:
    """With a sink, each copy must read what a session holding the sink, then its block, then the
    tokens reads, at the same positions; the sink changes what the copies read."""
    be = models.fresh(model)
    be.prefill(models.tokens[:600])
    sink, blocks = be.save_block(0, 4), [be.save_block(300, 428), be.save_block(500, 537)]
    question = models.tokens[700:712]
    scores, forwarded = be.score_after_blocks(blocks, question, sink)
    plain, _ = be.score_after_blocks(blocks, question)
    assert forwarded == 2 * len(question) and be.attention_tokens == 600
    n, lead = len(question), 128 + 4
    for i, blk in enumerate(blocks):
        alone = models.fresh(model)
        start = lead + i * n - blk.n_tokens
        alone.insert_block(sink, 0, position=start - 4)
        alone.insert_block(blk, 4, position=start)
        steps = alone.prefill_logits(question)[:-1].astype(np.float64)
        steps -= steps.max(axis=1, keepdims=True)
        expected = steps[np.arange(n - 1), question[1:]] - np.log(np.exp(steps).sum(axis=1))
        np.testing.assert_allclose(scores[i], expected, atol=2e-4)
    assert np.abs(scores - plain).max() > 1e-3


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_a_block_prefilled_alone_is_a_fresh_sessions_and_leaves_the_session_as_it_was(models: Models,
                                                                                       model: str) -> None:
    be = models.fresh(model)
    be.prefill(models.tokens[:300])
    before, keys, logits = be.counters, be.rotated_keys(), be.last_logits()
    for span in (slice(400, 528), slice(10, 40)):   # the second, shorter, reads nothing of the first
        blk = be.prefill_alone(models.tokens[span])
        assert be.counters == before and be.attention_tokens == 300
        alone = models.fresh(model)
        alone.prefill(models.tokens[span])
        expected = alone.save_block(0, alone.attention_tokens)
        np.testing.assert_array_equal(blk.token_ids, expected.token_ids)
        np.testing.assert_array_equal(blk.positions, np.arange(expected.n_tokens))
        np.testing.assert_allclose(blk.keys, expected.keys, atol=1e-5)
        np.testing.assert_allclose(blk.values, expected.values, atol=1e-5)
    np.testing.assert_array_equal(be.rotated_keys(), keys)
    np.testing.assert_array_equal(be.last_logits(), logits)
    with pytest.raises(ValueError, match="at least one token"):
        be.prefill_alone([])


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-qwen3-next"])
def test_scoring_after_blocks_is_refused_for_stream_state(models: Models, model: str) -> None:
    be = models.fresh(model)
    be.prefill(models.tokens[:200])
    with pytest.raises(UnsupportedModelError, match="full attention"):
        be.score_after_blocks([be.save_block(0, 128)], models.tokens[:8])


def test_scoring_after_blocks_checks_its_input(models: Models) -> None:
    be = models.fresh("tiny-llama")
    be.prefill(models.tokens[:200])
    blk = be.save_block(0, 128)
    with pytest.raises(ValueError, match="two tokens"):
        be.score_after_blocks([blk], models.tokens[:1])
    with pytest.raises(ValueError, match="one block"):
        be.score_after_blocks([], models.tokens[:8])
    with pytest.raises(BlockMismatchError):
        be.score_after_blocks([_block(models, "tiny-qwen3")[1]],
                              models.tokens[:8])


@pytest.mark.parametrize("model", TINY)
def test_accounting_invariant_after_random_mixes(models: Models, harness: Harness, model: str) -> None:
    """Random prefill / decode / evict / restore / compact, with a small position limit so automatic
    compaction happens too. After every step the accounting holds and the held tokens are the
    expected ones; at the end every key equals the model's own rotation at its position."""
    be = models.fresh(model, position_limit=700)
    rng = np.random.default_rng(7)
    stream: list[int] = []  # every token the model has seen, in order
    held: list[int] = []  # stream indices of the held tokens, in logical order
    evicted: list[tuple[int, bytes, list[int]]] = []  # LIFO: (at, block bytes, stream indices)
    text = models.tokens
    pending: int | None = None  # the token decode returned last, not yet fed
    with harness.capture_prerope_keys(be) as captured:
        for _ in range(120):
            roll = rng.random()
            if roll < 0.25 or not held:
                n = int(rng.integers(1, 90))
                chunk = text[len(stream) % 1000:len(stream) % 1000 + n]
                be.prefill(chunk)
                held += list(range(len(stream), len(stream) + len(chunk)))
                stream += chunk
                pending = None
            elif roll < 0.5:
                for _ in range(int(rng.integers(1, 5))):
                    if pending is not None:
                        stream.append(pending)
                        held.append(len(stream) - 1)
                    pending = be.decode()
                if rng.random() < 0.3:
                    forced = text[len(stream) % 1000]
                    stream.append(forced)
                    held.append(len(stream) - 1)
                    pending = be.decode(token=forced)
            elif roll < 0.75 and len(held) > 40:
                n = int(rng.integers(1, 40))
                at = int(rng.integers(0, len(held) - n))
                evicted.append((at, be.save_block(at, at + n).to_bytes(), held[at:at + n]))
                be.remove_attention_range(at, at + n)
                del held[at:at + n]
            elif roll < 0.95 and evicted:
                at, data, indices = evicted.pop()
                be.insert_block(Block.from_bytes(data, expect=be.layer_view), at)
                held[at:at] = indices
            else:
                be.compact_positions()
            c = be.counters
            assert c.model_forward_tokens == c.new_prefill_tokens + c.decoded_tokens == len(stream)
            assert c.historical_forward_during_restore == 0
            assert be.stream_tokens == len(stream) and be.attention_tokens == len(held)
            np.testing.assert_array_equal(be.held_token_ids(), np.asarray([stream[i] for i in held]))
            positions = be.positions()
            assert bool(np.all(np.diff(positions) > 0))
            if roll < 0.5:
                # A forward never hands out a position >= the limit while gaps could be closed.
                assert positions.max() < 700 or np.array_equal(positions, np.arange(len(held)))
    while evicted:
        at, data, indices = evicted.pop()
        be.insert_block(Block.from_bytes(data, expect=be.layer_view), at)
        held[at:at] = indices
    assert be.counters.compactions > 0 and be.counters.restored_tokens == be.counters.evicted_tokens
    canon = np.stack([np.concatenate(chunks, axis=0) for chunks in captured]).transpose(0, 2, 1, 3)
    expected = harness.model_rotate(be, canon[:, :, held], be.positions())
    assert float(np.abs(be.rotated_keys() - expected).max()) <= 1e-5
