"""The backend protocol, defined once, and the canonical forms that cross it.

A backend runs one model over one session's token stream and exposes exact, attention-only page
operations on its cache: save a logical range of attention K/V as a canonical `Block`, remove a
range from the attention layers only, insert a block back, and snapshot the recurrent state of
hybrid models. Everything here is runtime-neutral: tensors cross the protocol as numpy arrays.

Dependency rules: this module imports numpy, msgpack and xxhash only. Backends know nothing about
contextd, the controller or any paging policy; those layers call this protocol, never the reverse.

Index convention: `start`, `end` and `at` address the *logical order of the tokens held in
attention*, 0 .. `attention_tokens`, i.e. the order of the session text among the hot tokens. They
are not slot numbers and not RoPE positions; a backend maps them to both.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgpack
import numpy as np
import xxhash

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "Block",
    "BlockFormatError",
    "BlockMismatchError",
    "Counters",
    "LayerView",
    "RecurrentSnapshot",
    "Tokenizer",
    "UnsupportedModelError",
    "FORMAT_VERSION",
    "IO_CHUNK_BYTES",
    "BlockFileReader",
    "read_verified",
    "restore_block_file",
    "write_durable",
]


class BackendError(Exception):
    """Base class of every error a backend raises on purpose."""


class UnsupportedModelError(BackendError):
    """The model cannot be served exactly; the message names what is missing."""


class BackendUnavailableError(BackendError):
    """The named runtime is not installed or not usable on this machine."""


class BlockMismatchError(BackendError):
    """A block (or recurrent snapshot) was produced by another model, layer view or dtype."""


class BlockFormatError(BackendError):
    """Bytes that do not decode as a block or snapshot of a known format version."""


# Storage dtypes. bfloat16 has no numpy dtype, so its raw 16-bit patterns travel as uint16 and the
# metadata carries the real name; a backend reinterprets the bits, it never converts values.
_NUMPY_STORAGE: dict[str, str] = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}

ROPE_LAYOUT_NEOX = "neox"


def storage_dtype(dtype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype a tensor of model dtype `dtype` is stored as."""
    try:
        return np.dtype(_NUMPY_STORAGE[dtype])
    except KeyError:
        raise BlockFormatError(f"unsupported tensor dtype {dtype!r}; known: {sorted(_NUMPY_STORAGE)}") from None


@dataclasses.dataclass(frozen=True)
class LayerView:
    """What a block's tensors mean: which model, which layers, which head and rotary layout.

    Two views must be equal field by field for a block to be inserted. `model_id` is a content
    hash of the model configuration and weights, so two checkpoints with the same architecture
    still differ.
    """

    model_id: str
    family: str
    attention_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int
    rope_layout: str
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["attention_layers"] = list(self.attention_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerView:
        try:
            return cls(
                model_id=str(d["model_id"]),
                family=str(d["family"]),
                attention_layers=tuple(int(i) for i in d["attention_layers"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_dim=int(d["head_dim"]),
                value_head_dim=int(d["value_head_dim"]),
                rotary_dim=int(d["rotary_dim"]),
                rope_layout=str(d["rope_layout"]),
                dtype=str(d["dtype"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BlockFormatError(f"layer view metadata is incomplete or malformed: {e}") from None

    def differences(self, other: LayerView) -> list[str]:
        """Names of the fields where `other` differs from this view."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def require_same(self, other: LayerView, what: str = "block") -> None:
        """Raise `BlockMismatchError` naming every differing field unless `other` equals this view."""
        diff = self.differences(other)
        if diff:
            parts = ", ".join(f"{n}: {getattr(other, n)!r} != {getattr(self, n)!r}" for n in diff)
            raise BlockMismatchError(f"{what} does not fit this backend's layer view ({what} vs backend) - {parts}")


@dataclasses.dataclass(frozen=True)
class Block:
    """K/V of every attention layer for a run of tokens, in canonical, position-independent form.

    keys:   [layers, kv_heads, tokens, head_dim], the key as the model computes it *before* the
            rotary embedding (after k_norm where the model has one). Storage dtype per `view.dtype`.
    values: [layers, kv_heads, tokens, value_head_dim].
    positions: int64 [tokens], the RoPE positions the tokens held when saved (a hint for re-use).
    token_ids: int32 [tokens], so a caller can check a block against its transcript.
    """

    view: LayerView
    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    model_name: str = ""

    MAGIC: ClassVar[bytes] = b"KVEBLOCK"

    def __post_init__(self) -> None:
        v = self.view
        n = int(self.positions.shape[0]) if self.positions.ndim == 1 else -1
        want_k = (len(v.attention_layers), v.num_kv_heads, n, v.head_dim)
        want_v = (len(v.attention_layers), v.num_kv_heads, n, v.value_head_dim)
        if tuple(self.keys.shape) != want_k or tuple(self.values.shape) != want_v:
            raise BlockFormatError(
                f"block tensors have shapes keys={tuple(self.keys.shape)} values={tuple(self.values.shape)}, "
                f"the layer view needs {want_k} and {want_v}"
            )
        if self.token_ids.shape != (n,):
            raise BlockFormatError(f"token_ids has shape {self.token_ids.shape}, expected ({n},)")
        if n > 1 and not bool(np.all(np.diff(self.positions) > 0)):
            raise BlockFormatError("block positions must be strictly increasing")
        st = storage_dtype(v.dtype)
        if self.keys.dtype.newbyteorder("<") != st or self.values.dtype.newbyteorder("<") != st:
            raise BlockFormatError(f"block tensors are {self.keys.dtype}/{self.values.dtype}, view says {v.dtype}")

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def _pieces(self) -> list[memoryview]:
        meta = {
            "kind": "kv-block",
            "view": self.view.to_dict(),
            "n_tokens": self.n_tokens,
            "model_name": self.model_name,
        }
        st = storage_dtype(self.view.dtype)
        return _pack(
            self.MAGIC,
            meta,
            # Positions and token ids first: a streaming reader needs them before the keys arrive.
            [
                ("positions", np.ascontiguousarray(self.positions, dtype="<i8")),
                ("token_ids", np.ascontiguousarray(self.token_ids, dtype="<i4")),
                ("keys", np.ascontiguousarray(self.keys, dtype=st)),
                ("values", np.ascontiguousarray(self.values, dtype=st)),
            ],
        )

    def to_bytes(self) -> bytes:
        return b"".join(self._pieces())

    def to_file(self, path: str | os.PathLike[str]) -> int:
        """Write the block durably (temp + fsync + rename) straight from its arrays; return its size."""
        return write_durable(path, self._pieces())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, expect: LayerView | None = None) -> Block:
        """Read and verify a block file (checksummed while reading)."""
        data, digest = read_verified(path)
        return cls.from_bytes(data, expect=expect, payload_digest=digest)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, expect: LayerView | None = None,
                   verify: bool = True, payload_digest: int | None = None) -> Block:
        """Decode a block; arrays are zero-copy views into `data` (read-only for `bytes`).

        `expect`: refuse (BlockMismatchError) unless the block's view equals it. `verify`: check the
        payload checksum (xxh3-64; cheap next to a disk read, and a flipped bit in a key is silent).
        `payload_digest`: the payload's xxh3-64 when the caller already computed it while reading.
        """
        meta, arrays = _unpack(cls.MAGIC, data, verify=verify, payload_digest=payload_digest)
        if meta.get("kind") != "kv-block":
            raise BlockFormatError(f"not a kv block (kind={meta.get('kind')!r})")
        view = LayerView.from_dict(meta.get("view", {}))
        if expect is not None:
            expect.require_same(view)
        try:
            return cls(
                view=view,
                keys=arrays["keys"],
                values=arrays["values"],
                positions=arrays["positions"],
                token_ids=arrays["token_ids"],
                model_name=str(meta.get("model_name", "")),
            )
        except KeyError as e:
            raise BlockFormatError(f"block is missing section {e}") from None


@dataclasses.dataclass(frozen=True)
class RecurrentSnapshot:
    """Conv and recurrent states of every linear-attention (e.g. Gated DeltaNet) layer.

    `states` maps "conv/<layer>/<state>" and "recurrent/<layer>/<state>" to host copies in storage
    dtype; `dtypes` gives each array's model dtype name (recurrent states are often float32 in a
    bfloat16 model). `stream_tokens` is the number of tokens the states have consumed.
    """

    model_id: str
    stream_tokens: int
    states: dict[str, np.ndarray]
    dtypes: dict[str, str]

    MAGIC: ClassVar[bytes] = b"KVESNAP\x00"

    def __post_init__(self) -> None:
        if self.states.keys() != self.dtypes.keys():
            raise BlockFormatError("every snapshot state needs a dtype and vice versa")
        for key, arr in self.states.items():
            if arr.dtype.newbyteorder("<") != storage_dtype(self.dtypes[key]):
                raise BlockFormatError(f"state {key} is stored as {arr.dtype}, its dtype says {self.dtypes[key]}")

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.states.values()))

    def equals(self, other: RecurrentSnapshot | None) -> bool:
        """Bit-for-bit equality of every state tensor and of what they cover."""
        if other is None:
            return False
        if (self.model_id, self.stream_tokens, self.dtypes) != (other.model_id, other.stream_tokens, other.dtypes):
            return False
        if self.states.keys() != other.states.keys():
            return False
        return all(
            a.shape == other.states[k].shape and a.tobytes() == other.states[k].tobytes()
            for k, a in self.states.items()
        )

    def _pieces(self) -> list[memoryview]:
        meta = {"kind": "recurrent-snapshot", "model_id": self.model_id,
                "stream_tokens": self.stream_tokens, "dtypes": dict(sorted(self.dtypes.items()))}
        sections = [(k, np.ascontiguousarray(self.states[k])) for k in sorted(self.states)]
        return _pack(self.MAGIC, meta, sections)

    def to_bytes(self) -> bytes:
        return b"".join(self._pieces())

    def to_file(self, path: str | os.PathLike[str]) -> int:
        """Write the snapshot durably (temp + fsync + rename); return its size in bytes."""
        return write_durable(path, self._pieces())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RecurrentSnapshot:
        data, digest = read_verified(path)
        return cls.from_bytes(data, payload_digest=digest)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, verify: bool = True,
                   payload_digest: int | None = None) -> RecurrentSnapshot:
        meta, arrays = _unpack(cls.MAGIC, data, verify=verify, payload_digest=payload_digest)
        if meta.get("kind") != "recurrent-snapshot":
            raise BlockFormatError(f"not a recurrent snapshot (kind={meta.get('kind')!r})")
        try:
            return cls(model_id=str(meta["model_id"]), stream_tokens=int(meta["stream_tokens"]),
                       states=arrays, dtypes={str(k): str(v) for k, v in meta["dtypes"].items()})
        except (KeyError, AttributeError) as e:
            raise BlockFormatError(f"snapshot metadata is incomplete: {e}") from None


@dataclasses.dataclass
class Counters:
    """Forward-token accounting, kept by the backend itself.

    Every token fed by `prefill` or `decode` is counted once, as `new_prefill_tokens` or
    `decoded_tokens`. `model_forward_tokens` is counted separately, where tokens enter the model
    (the torch backend uses a pre-hook on the embedding), so `model_forward_tokens ==
    new_prefill_tokens + decoded_tokens` is a real check, not an identity.
    `historical_forward_during_restore` counts tokens entering the model while a page operation
    is in progress; no page operation runs the model, so it stays 0, but it is measured, so a
    regression shows up as a number instead of a silent slowdown.
    `reanchored_keys` counts token keys (each across all attention layers and heads) rotated to a
    new position from their canonical form, including the keys of a restored page.
    """

    model_forward_tokens: int = 0
    new_prefill_tokens: int = 0
    decoded_tokens: int = 0
    historical_forward_during_restore: int = 0
    restored_tokens: int = 0
    evicted_tokens: int = 0
    reanchored_keys: int = 0
    compactions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def copy(self) -> Counters:
        return dataclasses.replace(self)


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a tokenizer the protocol relies on (Hugging Face and mlx-lm wrappers both fit)."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """One model, one session: a hot attention cache with exact page operations.

    Positions: each held token carries a RoPE position; positions increase along the logical order
    but may leave gaps (an eviction leaves one; nothing is re-anchored until `compact_positions`,
    which runs when asked or when the next position would leave the configured range). Inserting a
    block re-uses its saved positions when they still fit, otherwise it takes the positions after
    its left neighbour and shifts later tokens up only as far as the next gap.
    """

    name: str
    """Runtime name, e.g. "torch"."""
    device: str
    model_name: str

    @property
    def model_id(self) -> str: ...

    @property
    def layer_view(self) -> LayerView: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def is_hybrid(self) -> bool:
        """True when the model has recurrent (linear-attention) layers next to attention layers."""
        ...

    @property
    def max_position(self) -> int:
        """Largest RoPE position inside the model's trained range."""
        ...

    @property
    def attention_tokens(self) -> int:
        """Tokens now held by the attention layers."""
        ...

    @property
    def stream_tokens(self) -> int:
        """Tokens the model has consumed in this session (what the recurrent state covers)."""
        ...

    @property
    def pending_token(self) -> int | None:
        """The token `decode` returned last, not yet fed to the model (None after prefill)."""
        ...

    @property
    def counters(self) -> dict[str, int]: ...

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append exactly `token_ids` to the cache; return float32 logits of the last position.

        A pending token from `decode` is dropped: callers include it in `token_ids` when it belongs
        to the transcript.
        """
        ...

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        """One step: feed `token` (default: the pending token, if any), then pick the next token.

        Right after `prefill` nothing is fed and the token is picked from the prefill logits. The
        returned token becomes pending. `seed` reseeds the backend's sampler before sampling.
        """
        ...

    def last_logits(self) -> np.ndarray:
        """float32 logits the next `decode` picks from."""
        ...

    def save_block(self, start: int, end: int) -> Block:
        """Canonical K/V of every attention layer for held tokens [start, end) (logical order)."""
        ...

    def remove_attention_range(self, start: int, end: int) -> None:
        """Drop held tokens [start, end) from the attention layers only; recurrent state untouched."""
        ...

    def insert_block(self, blk: Block, at: int) -> None:
        """Put `blk`'s tokens logically before the held token now at index `at` (`at` may equal
        `attention_tokens`). Raises BlockMismatchError for a block of another model or layout."""
        ...

    def compact_positions(self) -> int:
        """Renumber held tokens densely from 0; re-anchor only keys whose position changed.
        Returns the number of token keys re-anchored."""
        ...

    def positions(self) -> np.ndarray:
        """int64 RoPE positions of the held tokens, in logical order."""
        ...

    def held_token_ids(self) -> np.ndarray:
        """int32 ids of the held tokens, in logical order."""
        ...

    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """float32 keys as attention sees them (rotated at their positions): [layers, heads, n, dim]."""
        ...

    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        """Copy of the conv + recurrent states; None for models without recurrent layers."""
        ...

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        """Overwrite the recurrent states with `snap` (the caller keeps attention consistent).

        Clears the last logits and the pending token: the next step must feed a token."""
        ...

    def synchronize(self) -> None:
        """Wait until queued device work is done (for timing; a no-op on synchronous devices)."""
        ...

    def fork(self) -> Backend:
        """An independent session sharing the model weights, with a copy of this cache and counters."""
        ...

    def reset(self) -> None:
        """Empty the session (cache, recurrent state, pending token); counters are kept."""
        ...


# ----------------------------------------------------------------------------------------------
# The container format shared by blocks and recurrent snapshots (documented in docs/backends.md).
#
#   offset 0   8 bytes   magic (b"KVEBLOCK" or b"KVESNAP\0")
#   offset 8   u16 LE    format version
#   offset 10  u16 LE    flags (0)
#   offset 12  u32 LE    header length H
#   offset 16  H bytes   msgpack map: metadata + "sections" + "payload_len" + "payload_xxh3"
#   then zero padding to a multiple of 64; the payload starts there
#   payload    sections in header order, each at a 64-byte aligned offset (relative to payload
#              start), C-order little-endian raw bytes, zero padding between sections
# ----------------------------------------------------------------------------------------------

FORMAT_VERSION = 1
_ALIGN = 64
_PREFIX = struct.Struct("<8sHHI")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(magic: bytes, meta: dict[str, Any], sections: list[tuple[str, np.ndarray]]) -> list[memoryview]:
    """The container as a list of buffers (header, padding, the arrays' own memory): joining them
    gives the bytes, writev-ing them writes the file without assembling a copy first."""
    table: list[list[Any]] = []
    payload: list[memoryview] = []
    hasher = xxhash.xxh3_64()
    offset = 0
    for name, arr in sections:
        le = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        table.append([name, le.dtype.str, list(le.shape), offset, int(le.nbytes)])
        data = le.reshape(-1).view(np.uint8).data
        pad = memoryview(bytes(_align(offset + le.nbytes) - offset - le.nbytes))
        for piece in (data, pad):
            if len(piece):
                hasher.update(piece)
                payload.append(piece)
        offset = _align(offset + le.nbytes)
    header = dict(meta)
    header["sections"] = table
    header["payload_len"] = offset
    header["payload_xxh3"] = hasher.intdigest()
    hbytes = msgpack.packb(header, use_bin_type=True)
    head = _PREFIX.pack(magic, FORMAT_VERSION, 0, len(hbytes)) + hbytes
    return [memoryview(head + bytes(_align(len(head)) - len(head))), *payload]


def _parse_header(magic: bytes, mv: memoryview) -> tuple[dict[str, Any], int]:
    """Decode the prefix and msgpack header at the start of `mv`; return it and the payload offset."""
    if len(mv) < _PREFIX.size:
        raise BlockFormatError(f"{len(mv)} bytes is too short for a header")
    got_magic, version, _flags, hlen = _PREFIX.unpack_from(mv, 0)
    if got_magic != magic:
        raise BlockFormatError(f"bad magic {got_magic!r}, expected {magic!r}")
    if version != FORMAT_VERSION:
        raise BlockFormatError(f"format version {version} is not supported (this build reads {FORMAT_VERSION})")
    if _PREFIX.size + hlen > len(mv):
        raise BlockFormatError("truncated header")
    try:
        header = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + hlen], raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise BlockFormatError(f"header does not decode: {e}") from None
    if not isinstance(header, dict):
        raise BlockFormatError("header is not a map")
    return header, _align(_PREFIX.size + hlen)


def _sections(header: dict[str, Any], payload: memoryview) -> dict[str, np.ndarray]:
    """Zero-copy arrays over `payload` for every section the header lists (validated first)."""
    payload_len = int(header.get("payload_len", -1))
    arrays: dict[str, np.ndarray] = {}
    for entry in header.get("sections", []):
        try:
            name, dt, shape, off, nbytes = entry
            dtype = np.dtype(dt)
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        except (TypeError, ValueError) as e:
            raise BlockFormatError(f"bad section entry {entry!r}: {e}") from None
        little = dtype == dtype.newbyteorder("<")
        if not little or count * dtype.itemsize != nbytes or off < 0 or off + nbytes > payload_len:
            raise BlockFormatError(f"section {name!r} is inconsistent with the payload")
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=off).reshape(shape)
    return arrays


def _unpack(magic: bytes, data: bytes | bytearray | memoryview, *, verify: bool,
            payload_digest: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    mv = memoryview(data).cast("B")
    header, start = _parse_header(magic, mv)
    payload_len = int(header.get("payload_len", -1))
    if payload_len < 0 or start + payload_len != len(mv):
        raise BlockFormatError(f"payload length mismatch: header says {payload_len}, "
                               f"{len(mv) - start} bytes follow the header")
    payload = mv[start:]
    if verify:
        digest = xxhash.xxh3_64_intdigest(payload) if payload_digest is None else payload_digest
        if digest != header.get("payload_xxh3"):
            raise BlockFormatError("payload checksum mismatch (corrupted block)")
    return header, _sections(header, payload)


# Cold reads in 64 KiB requests let kernel readahead run ahead of the copy (one request for a whole
# 6 MB block was ~40% slower on a virtio disk), and hashing each request right after it lands hits
# the CPU cache instead of reading the whole payload back from memory.
IO_CHUNK_BYTES = 64 * 1024
# Copies out of the page cache have no readahead to keep ahead of: bigger requests, fewer calls.
_CACHED_CHUNK_BYTES = 1024 * 1024
_IOV_MAX = 512


def write_durable(path: str | os.PathLike[str], data: bytes | Sequence[memoryview]) -> int:
    """Write `data` (bytes, or buffers written back to back) to `path` atomically and durably:
    temp file, fsync, rename, fsync of the directory. Returns the number of bytes written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    pending = [memoryview(data)] if isinstance(data, bytes) else [p.cast("B") for p in data if len(p)]
    total = sum(len(p) for p in pending)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while pending:
            written = os.writev(fd, pending[:_IOV_MAX])
            if written <= 0:
                raise OSError(f"{tmp}: write made no progress")
            while written and written >= len(pending[0]):
                written -= len(pending.pop(0))
            if written:
                pending[0] = pending[0][written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return total


def read_verified(path: str | os.PathLike[str]) -> tuple[memoryview, int]:
    """Read a block / snapshot file; return its bytes and the xxh3-64 of its payload, hashed while
    reading. Pass both to `from_bytes(data, payload_digest=...)`."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        # Uninitialised: every byte is overwritten, and zero-filling 6 MB cost ~0.3 ms per block.
        view = np.empty(size, dtype=np.uint8).data
        hasher = xxhash.xxh3_64()
        payload_start: int | None = None
        got = hashed = 0
        while got < size:
            n = f.readinto(view[got:got + IO_CHUNK_BYTES])
            if not n:
                raise BlockFormatError(f"{path}: file shrank while reading")
            got += n
            if payload_start is None and got >= _PREFIX.size:
                payload_start = _align(_PREFIX.size + _PREFIX.unpack_from(view, 0)[3])
            if payload_start is not None and got > payload_start:
                lo = max(hashed, payload_start)
                hasher.update(view[lo:got])
                hashed = got
    return view, hasher.intdigest()


class BlockFileReader:
    """Reads a block file on a background thread so a backend can insert what has arrived while
    the rest is still coming from disk (restore = max(read, insert) instead of read + insert).

        with BlockFileReader(path, expect=backend.layer_view) as rd:
            rd.wait("positions")                 # arrays[...] are views into the buffer being filled
            rd.wait("keys", rows=4)              # the first 4 layers of keys have arrived
            blk = rd.finish()                    # all read, checksum verified: only now commit

    The header is read and checked (magic, version, kind, layer view) in the constructor. Nothing
    read may be *committed* before `finish()` returns: until then the checksum is unverified.
    """

    def __init__(self, path: str | os.PathLike[str], *, expect: LayerView | None = None) -> None:
        self._file = open(path, "rb", buffering=0)  # closed by close(), also on a failed header
        try:
            self._size = os.fstat(self._file.fileno()).st_size
            self._mv = np.empty(self._size, dtype=np.uint8).data
            self._got = 0
            self._fill(min(self._size, IO_CHUNK_BYTES))
            if self._got >= _PREFIX.size:
                self._fill(min(self._size, _align(_PREFIX.size + _PREFIX.unpack_from(self._mv, 0)[3])))
            self.header, self._start = _parse_header(Block.MAGIC, self._mv[:self._got])
            if self.header.get("kind") != "kv-block":
                raise BlockFormatError(f"not a kv block (kind={self.header.get('kind')!r})")
            payload_len = int(self.header.get("payload_len", -1))
            if payload_len < 0 or self._start + payload_len != self._size:
                raise BlockFormatError(f"payload length mismatch: header says {payload_len}, "
                                       f"{self._size - self._start} bytes follow the header")
            self.view = LayerView.from_dict(self.header.get("view", {}))
            if expect is not None:
                expect.require_same(self.view)
            self.arrays = _sections(self.header, self._mv[self._start:])
            missing = {"keys", "values", "positions", "token_ids"} - self.arrays.keys()
            if missing:
                raise BlockFormatError(f"block is missing sections {sorted(missing)}")
            self._offsets = {e[0]: (int(e[3]), int(e[4])) for e in self.header["sections"]}
        except BaseException:
            self._file.close()
            raise
        self._hasher = xxhash.xxh3_64()
        if self._got > self._start:
            self._hasher.update(self._mv[self._start:self._got])
        self._take_cached()
        self._cond = threading.Condition()
        self._wanted = self._size
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if self._got < self._size:
            self._file.seek(self._got)
            self._thread = threading.Thread(target=self._run, name="kv-block-reader", daemon=True)
            self._thread.start()

    def _take_cached(self) -> None:
        """Copy whatever the page cache already holds without waiting for the disk (RWF_NOWAIT).
        A recently written block is usually all there, and then a reader thread would only add
        hand-offs; where the flag is missing, everything goes through the thread."""
        nowait = getattr(os, "RWF_NOWAIT", None)
        if nowait is None:
            return
        fd = self._file.fileno()
        while self._got < self._size:
            try:
                n = os.preadv(fd, [self._mv[self._got:self._got + _CACHED_CHUNK_BYTES]], self._got, nowait)
            except OSError:
                return
            if n <= 0:
                return
            self._hasher.update(self._mv[max(self._got, self._start):self._got + n])
            self._got += n

    @property
    def n_tokens(self) -> int:
        return int(self.arrays["positions"].shape[0])

    def _fill(self, upto: int) -> None:
        while self._got < upto:
            n = self._file.readinto(self._mv[self._got:min(upto, self._got + IO_CHUNK_BYTES)])
            if not n:
                raise BlockFormatError("block file is shorter than its header says")
            self._got += n

    def _run(self) -> None:
        try:
            got = self._got
            while got < self._size and not self._stop:
                n = self._file.readinto(self._mv[got:got + IO_CHUNK_BYTES])
                if not n:
                    raise BlockFormatError("block file shrank while reading")
                self._hasher.update(self._mv[max(got, self._start):got + n])
                got += n
                # Publish progress, but wake the consumer only once what it waits for is here.
                with self._cond:
                    self._got = got
                    if got >= self._wanted or got == self._size:
                        self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def wait(self, section: str, rows: int | None = None) -> None:
        """Block until `section` (or its first `rows` entries along axis 0) has been read."""
        off, nbytes = self._offsets[section]
        if rows is not None:
            shape = self.arrays[section].shape
            nbytes = nbytes // max(1, int(shape[0])) * rows
        end = self._start + off + nbytes
        with self._cond:
            self._wanted = end
            while self._got < end and self._error is None:
                self._cond.wait()
            if self._error is not None and self._got < end:
                raise self._error

    def finish(self) -> Block:
        """Wait for the whole file, verify its checksum and return the block."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._hasher.intdigest() != self.header.get("payload_xxh3"):
            raise BlockFormatError("payload checksum mismatch (corrupted block)")
        a = self.arrays
        return Block(view=self.view, keys=a["keys"], values=a["values"], positions=a["positions"],
                     token_ids=a["token_ids"], model_name=str(self.header.get("model_name", "")))

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        self._file.close()

    def __enter__(self) -> BlockFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore_block_file(be: Backend, path: str | os.PathLike[str], at: int) -> None:
    """Insert the block stored at `path` before the held token now at logical index `at`.

    Equivalent to `be.insert_block(Block.from_file(path, expect=be.layer_view), at)`. A runtime
    that can overlap the disk read with the insert offers `insert_block_file(path, at)` (the torch
    backend does, with `BlockFileReader`); this uses it when present. Either way nothing is
    committed unless the whole file verifies.
    """
    streaming = getattr(be, "insert_block_file", None)
    if callable(streaming):
        streaming(path, at)
    else:
        be.insert_block(Block.from_file(path, expect=be.layer_view), at)
