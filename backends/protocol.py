"""The backend protocol, defined once, and the canonical forms that cross it.

A backend runs one model over one session's token stream and exposes exact, attention-only page
operations on its cache: save a logical range of attention K/V as a canonical `Block`, remove a
range from the attention layers only, insert a block back (from memory or streamed from its
stored file), and snapshot the recurrent state of hybrid models. Everything here is
runtime-neutral: tensors cross the protocol as numpy arrays.

Index convention: `start`, `end` and `at` address the *logical order of the tokens held in
attention*, 0 .. `attention_tokens`, i.e. the order of the session text among the hot tokens. They
are not slot numbers and not RoPE positions; a backend maps them to both.

Dependency rules: numpy and backends.blockfile only. Backends know nothing about contextd, the
controller or any paging policy; those layers call this protocol, never the reverse.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from . import blockfile

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "Block",
    "BlockFormatError",
    "BlockMismatchError",
    "BlockStream",
    "Counters",
    "CorruptPayloadError",
    "DecodeStep",
    "LayerView",
    "ROPE_LAYOUT_NEOX",
    "ROPE_LAYOUT_NONE",
    "RecurrentSnapshot",
    "STORAGE_DTYPES",
    "StoredBlock",
    "Tokenizer",
    "UnsupportedModelError",
    "storage_dtype",
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


class CorruptPayloadError(BlockFormatError):
    """A stored payload that is not what its manifest record says: its size or checksum differs,
    its container does not read, or it holds other tokens than the caller expected. The page is
    corrupt; a block of another model, layer view or dtype is a `BlockMismatchError` instead."""


# Storage dtypes. bfloat16 has no numpy dtype, so its raw 16-bit patterns travel as uint16 and the
# metadata carries the real name; a backend reinterprets the bits, it never converts values.
STORAGE_DTYPES: dict[str, str] = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}

ROPE_LAYOUT_NEOX = "neox"
ROPE_LAYOUT_NONE = "none"  # no rotary embedding (NoPE): keys are position-free, re-anchoring is a copy


def storage_dtype(dtype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype a tensor of model dtype `dtype` is stored as."""
    try:
        return np.dtype(STORAGE_DTYPES[dtype])
    except KeyError:
        raise BlockFormatError(f"unsupported tensor dtype {dtype!r}; known: {sorted(STORAGE_DTYPES)}") from None


def _read_stored(path: str | os.PathLike[str], checksum: str, size: int) -> memoryview:
    """A stored file's bytes, verified against the manifest's checksum and size."""
    try:
        return blockfile.read_verified(path, checksum, size)
    except blockfile.ContainerError as e:
        raise CorruptPayloadError(str(e)) from None
    except FileNotFoundError:
        raise BlockFormatError(f"{os.fspath(path)} is missing") from None


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
    """K/V of every paged (global-attention) layer for a run of tokens, in canonical,
    position-independent form. Sliding-window, recurrent and kv-shared layers are never in a block.

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

    def pieces(self, compress: bool = False) -> list[memoryview]:
        """The block file as buffers (see backends.blockfile); joined they are the file. With
        `compress`, keys and values are stored shuffle-zstd compressed, one frame per layer."""
        meta = {"kind": "kv-block", "view": self.view.to_dict(), "n_tokens": self.n_tokens,
                "model_name": self.model_name}
        st = storage_dtype(self.view.dtype)
        return blockfile.pack(
            self.MAGIC,
            meta,
            # Positions and token ids first: a streaming reader needs them before the keys arrive.
            [
                ("positions", np.ascontiguousarray(self.positions, dtype="<i8")),
                ("token_ids", np.ascontiguousarray(self.token_ids, dtype="<i4")),
                ("keys", np.ascontiguousarray(self.keys, dtype=st)),
                ("values", np.ascontiguousarray(self.values, dtype=st)),
            ],
            compress=frozenset({"keys", "values"}) if compress else frozenset(),
        )

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, expect: LayerView | None = None) -> Block:
        """Decode a block; arrays are zero-copy views into `data` (read-only for `bytes`).
        `expect`: refuse (BlockMismatchError) unless the block's view equals it."""
        try:
            meta, arrays = blockfile.unpack(cls.MAGIC, data)
        except blockfile.ContainerError as e:
            raise BlockFormatError(str(e)) from None
        return cls._from_parts(meta, arrays, expect)

    @classmethod
    def read(cls, path: str | os.PathLike[str], checksum: str, size: int, *,
             expect: LayerView | None = None) -> Block:
        """Read a stored block file whole, verifying the manifest's checksum and size."""
        return cls.from_bytes(_read_stored(path, checksum, size), expect=expect)

    @classmethod
    def read_layer_keys(cls, path: str | os.PathLike[str], layer: int) -> np.ndarray:
        """The canonical keys [kv_heads, tokens, head_dim] of the block's `layer`-th attention layer,
        read alone and NOT verified: for a selector's index (a restart rebuilds it without reading
        whole pages), never for attention."""
        try:
            return np.asarray(blockfile.read_rows(path, cls.MAGIC, "keys", layer, layer + 1)[0])
        except blockfile.ContainerError as e:
            raise BlockFormatError(str(e)) from None
        except FileNotFoundError:
            raise BlockFormatError(f"{os.fspath(path)} is missing") from None

    @classmethod
    def _from_parts(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray], expect: LayerView | None) -> Block:
        if meta.get("kind") != "kv-block":
            raise BlockFormatError(f"not a kv block (kind={meta.get('kind')!r})")
        view = LayerView.from_dict(meta.get("view", {}))
        if expect is not None:
            expect.require_same(view)
        try:
            return cls(view=view, keys=arrays["keys"], values=arrays["values"], positions=arrays["positions"],
                       token_ids=arrays["token_ids"], model_name=str(meta.get("model_name", "")))
        except KeyError as e:
            raise BlockFormatError(f"block is missing section {e}") from None


class BlockStream:
    """A stored block file read on a background thread (backends.blockfile.SectionReader), so a
    runtime inserts the layers that have arrived while the rest still comes from disk. Opening
    only opens the file: the header arrives on the thread, and the first call that needs it
    checks it (a block of another view raises there). `finish()` verifies the checksum. Nothing
    read may be committed before `finish()` returns.

    Opened `landing`, `land` says where the keys and values go: straight into a runtime's slots
    (what was read before is copied over), or into the reader's buffer (`land(None, None)`),
    from where `rows` gives them."""

    _LANDING = frozenset({"keys", "values"})

    def __init__(self, path: str | os.PathLike[str], checksum: str, size: int, *,
                 expect: LayerView | None = None, queue: blockfile.ReadQueue | None = None,
                 landing: bool = False, read_here: bool = False) -> None:
        try:
            self._reader = blockfile.SectionReader(path, Block.MAGIC, checksum, size, queue,
                                                   self._LANDING if landing else frozenset(), read_here)
        except blockfile.ContainerError as e:
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
            except blockfile.ContainerError as e:
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
        cache (a warm SmolLM2 page on the server's path, interleaved in one process: 8.91 ms
        copied against 11.05 landed; 8 cold pages 58.5 against 52.8 ms, 32 cold pages 221
        against 201 ms). Keys the inserting thread reads land in its own cache: a warm page 7.24
        -> 5.66 ms landed, a page restored warm again and again 5.22 -> 4.86 ms (20 interleaved
        rounds). Values, never rotated, land from any file (a warm page 10.99 -> 10.28 ms and
        8.43 -> 7.81 ms in two interleaved runs: the restoring thread no longer copies them)."""
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
        except blockfile.ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def arrived(self, section: str, rows: int) -> None:
        """Wait until the first `rows` rows (layers) of `keys` or `values` have been read."""
        self.check()
        self._wait(section, rows)

    def _wait(self, section: str, rows: int | None) -> None:
        try:
            self._reader.wait(section, rows)
        except blockfile.ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def finish(self) -> None:
        """Wait for the whole file and verify its checksum."""
        self.check()
        try:
            self._reader.finish()
        except blockfile.ContainerError as e:
            raise CorruptPayloadError(str(e)) from None

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> BlockStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One session's next decode, as `Backend.decode` takes it, for `Backend.decode_batch`:
    `backend` is that session's cache (this backend or one of its forks)."""

    backend: Backend
    token: int | None
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


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

    def pieces(self) -> list[memoryview]:
        meta = {"kind": "recurrent-snapshot", "model_id": self.model_id,
                "stream_tokens": self.stream_tokens, "dtypes": dict(sorted(self.dtypes.items()))}
        sections = [(k, np.ascontiguousarray(self.states[k])) for k in sorted(self.states)]
        return blockfile.pack(self.MAGIC, meta, sections)

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())

    @classmethod
    def read(cls, path: str | os.PathLike[str], checksum: str, size: int) -> RecurrentSnapshot:
        """Read a stored snapshot file, verifying the manifest's checksum and size."""
        return cls.from_bytes(_read_stored(path, checksum, size))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RecurrentSnapshot:
        try:
            meta, arrays = blockfile.unpack(cls.MAGIC, data)
        except blockfile.ContainerError as e:
            raise BlockFormatError(str(e)) from None
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
    `decoded_tokens`, and every held token recomputed in place (`recompute`, the blend) as
    `blend_forward_tokens`. `model_forward_tokens` is counted separately, where tokens enter the
    model (the torch backend uses a pre-hook on the embedding), so `model_forward_tokens ==
    new_prefill_tokens + decoded_tokens + blend_forward_tokens` is a real check, not an identity.
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
    blend_forward_tokens: int = 0
    forward_ns: int = 0  # wall time spent in the model's forward passes (page operations excluded)

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
        """True when the model keeps per-stream state outside the paged layers: recurrent (linear
        attention, Mamba) layers or sliding-window caches. `snapshot_recurrent` covers it, and a cut
        back must restore it from a snapshot."""
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
    def counters(self) -> Counters:
        """A copy of the session's forward-token accounting."""
        ...

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append exactly `token_ids` to the cache; return float32 logits of the last position.

        A pending token from `decode` is dropped: callers include it in `token_ids` when it belongs
        to the transcript.
        """
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """`prefill` without logits: for tokens the caller follows with more before it reads any
        (a turn's messages before the answer's opening). Counted as prefill; the cache and states
        are bit for bit those `prefill` leaves. Afterwards `last_logits` and a `decode` without a
        token refuse until a forward with logits. On MLX the lazy graph then never runs the last
        layer past its keys and values, as mlx-lm's own prefill does: on the tiny Qwen3-Next
        hybrid (4 layers) a quarter of the forward."""
        ...

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """`prefill`, returning the float32 logits after every token, [len(token_ids), vocab]: what
        teacher-forced scoring reads (serving.likelihood), one forward per chunk instead of one per
        token. Counted as prefill."""
        ...

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        """One step: feed `token` (default: the pending token, if any), then pick the next token.

        Right after `prefill` nothing is fed and the token is picked from the prefill logits. The
        returned token becomes pending. `seed` reseeds the backend's sampler before sampling.
        """
        ...

    @property
    def batches_decode(self) -> bool:
        """Whether `decode_batch` runs several sessions' steps as one forward (else one by one)."""
        ...

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[int]:
        """`decode` in each of several sessions that share this backend's weights (it and its
        forks, one step each), as one forward where the runtime batches them, else one after the
        other. Each session's counters, sampler and pending token move exactly as its own `decode`
        would move them. A batched row's logits equal its own decode's to float rounding, not bit
        for bit (other matrix kernels). A failed batched forward fails every session in it.
        """
        ...

    def last_logits(self) -> np.ndarray:
        """float32 logits the next `decode` picks from."""
        ...

    def save_block(self, start: int, end: int) -> Block:
        """Canonical K/V of every paged layer for held tokens [start, end) (logical order)."""
        ...

    def remove_attention_range(self, start: int, end: int) -> None:
        """Drop held tokens [start, end) from the attention layers only; recurrent state untouched."""
        ...

    def insert_block(self, blk: Block, at: int, *, position: int | None = None) -> None:
        """Put `blk`'s tokens logically before the held token now at index `at` (`at` may equal
        `attention_tokens`). Raises BlockMismatchError for a block of another model or layout.
        With `position`, its tokens take the positions from there on exactly (ValueError when
        they do not fit between the neighbours)."""
        ...

    def insert_block_file(self, path: str | os.PathLike[str], at: int, *, checksum: str, size: int,
                          token_ids: np.ndarray | None = None, position: int | None = None) -> None:
        """`insert_block(Block.read(path, checksum, size), at)` with the disk read overlapped: layers
        are re-anchored as they arrive (read straight into the slots where the runtime allows).
        With `token_ids`, a block holding other tokens is refused (CorruptPayloadError, as is a
        file failing its size or checksum) before anything is copied. Nothing becomes visible
        unless the whole file verifies."""
        ...

    def insert_block_files(self, files: Sequence[StoredBlock],
                           opened: Callable[[], object] | None = None) -> list[BlockFormatError | None]:
        """Insert several stored blocks in one page operation (`at` in ascending order, each counted
        in the held order before the call; blocks at the same place go in list order), with every
        file read ahead and in parallel and every held key re-anchored at most once. A block that
        fails its checks is left out and its error returned in its place (the others are placed
        as if it had never been asked for); a block of another model raises BlockMismatchError
        before anything is copied. Returns, per file, None (it went in) or its error. What went in
        is in the slots only: a caller wanting a block's keys reads them (Block.read_layer_keys).

        `opened`, if given, is called once, as soon as the first files are open and their first
        reads asked for (before anything is placed), even when none could be opened: what the
        caller does then overlaps the disk's first answer."""
        ...

    def score_after_blocks(self, blocks: Sequence[Block], token_ids: Sequence[int],
                           sink: Block | None = None) -> tuple[np.ndarray, int]:
        """How likely `token_ids` are right after each block, each block on its own: float64
        log p(token_ids[j] | block, token_ids[:j]) for j >= 1, [len(blocks), len(token_ids) - 1],
        and the tokens the scoring forward took. The blocks' exact K/V are the context (re-anchored
        right before their copy of the tokens; no forward over their tokens), with `sink`, if
        given, right before each block, and all copies run in one forward whose mask keeps each
        copy to its own sink and block. This session's cache, counters
        and logits are untouched. Raises UnsupportedModelError for a model with sliding-window or
        recurrent layers (their state is a stream, not separable per block), BlockMismatchError
        for a block of another model, ValueError for fewer than two tokens or no block."""
        ...

    def prefill_alone(self, token_ids: Sequence[int]) -> Block:
        """The K/V `token_ids` get when prefilled on their own from position 0, as a block
        (positions 0..n-1). This session's cache, counters and logits are untouched (a scratch
        session sharing the weights does the forward). ValueError for no tokens."""
        ...

    def recompute(self, indices: Sequence[int] | np.ndarray) -> int:
        """Recompute the K/V of the held tokens at logical `indices` in place, in the current view:
        one forward over them at their positions, each attending to the view at positions up to
        its own, their K/V written back layer by layer (the blend). Their exact K/V are kept:
        `save_block` returns those, `drop_recomputed` puts them back. Counted as
        `blend_forward_tokens`; afterwards a forward with logits must come before `decode`
        without a token. Returns the tokens recomputed. UnsupportedModelError on a model with
        recurrent layers; IndexError for an index outside the held tokens."""
        ...

    @property
    def recompute_refusal(self) -> str | None:
        """Why `recompute` refuses this model (it has recurrent layers), or None where it runs."""
        ...

    @property
    def recomputed_tokens(self) -> int:
        """Held tokens that hold recomputed K/V now."""
        ...

    def drop_recomputed(self) -> int:
        """Put back the exact K/V of every recomputed held token; return how many."""
        ...

    def observe_attention(self, queries: int, layers: Sequence[int]) -> None:
        """From now on the last forward of every `prefill` / `extend` reports the softmax weights
        its last `queries` tokens put on each held token at the paged layers `layers` (positions
        in `layer_view.attention_layers`), from the attention that forward computes anyway: no forward of
        its own. 0 queries or no layers: stop. ValueError for a layer the model does not page."""
        ...

    def attention_weights(self) -> np.ndarray | None:
        """The last forward's reported weights, float64 [attention_tokens] in held order: per held
        token, the weight a watched query put on it, averaged over watched layers, heads and
        queries (the rest of a query's weight is on sliding-window keys or a sink). None when that
        forward was not watched, or a forward or page operation came after it."""
        ...

    def compact_positions(self) -> int:
        """Renumber held tokens densely from 0; re-anchor only keys whose position changed.
        Returns the number of token keys re-anchored."""
        ...

    def reposition(self, positions: np.ndarray) -> int:
        """Give the held tokens (in logical order) these RoPE positions: distinct, non-negative,
        below the position limit, the last held token keeping the highest (new tokens follow it).
        Only keys whose position changes are re-anchored (arithmetic, no forward pass). Returns
        how many were. The logical order, and so every page's place, stays as it is."""
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
        """Copy of the conv + recurrent states and of the sliding-window caches; None for models
        with neither."""
        ...

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        """Overwrite the recurrent states and window caches with `snap` (the caller keeps attention
        consistent).

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
