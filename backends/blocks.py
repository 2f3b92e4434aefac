"""The canonical forms that cross the protocol and go to the store: `LayerView`, `Block` and
`RecurrentSnapshot`, with their encoding in the container format.

A `Block` is a run of tokens' K/V in every paged layer, in canonical, position-independent form
(keys before the rotary embedding), so it can go back at any position; its `LayerView` says what
its tensors mean, and a block is inserted only into a session whose view equals it field by field.
A `RecurrentSnapshot` is the per-stream state the pages do not hold (recurrent layers, sliding-
window caches). Tensors are numpy arrays in storage dtype (bfloat16 as its raw bits). Both encode
to, and decode from, the container of backends/blockfile.py, read whole and verified here; a
stored block read as it streams is backends/block_stream.py's.

Dependency rules: numpy, backends.blockfile and backends.errors only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import numpy as np

from . import blockfile
from .errors import BlockFormatError, BlockMismatchError, CorruptPayloadError

__all__ = [
    "Block",
    "LayerView",
    "ROPE_LAYOUT_NEOX",
    "ROPE_LAYOUT_NONE",
    "RecurrentSnapshot",
    "STORAGE_DTYPES",
    "storage_dtype",
]


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
