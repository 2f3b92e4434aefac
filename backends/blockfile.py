"""The container format of blocks and recurrent snapshots: writing it, and reading it whole.

    offset 0   8 bytes   magic (b"KVEBLOCK" or b"KVESNAP\\0")
    offset 8   u16 LE    format version (2)
    offset 10  u16 LE    flags (0)
    offset 12  u32 LE    header length H
    offset 16  H bytes   msgpack map: metadata + "sections" + "payload_len"
    then zero padding to a multiple of 64; the payload starts there
    payload    sections in header order, each at a 64-byte aligned offset (relative to payload
               start), C-order little-endian raw bytes, zero padding between sections

A section may be stored compressed (`pack(..., compress=...)`): codec "shuffle-zstd" splits each
row along axis 0 (a layer of keys or values) into its bytes' planes (all first bytes, all second
bytes, ... : the exponent bytes of floats compress, the low mantissa bytes hardly do) and
compresses each row with zstd as a frame of its own, so a streaming reader still decodes layer by
layer as they arrive. The section entry then carries the codec and each frame's offset and size.
Measured on SmolLM2-135M pages: 1.2x for float32 K/V, 1.47x for bfloat16 (zstd level 1).

A stored payload has exactly one checksum: xxh3-128 of the whole file, 32 lowercase hex digits,
computed by the canonical store while it writes the file (contextd.blobs) and recorded in the
manifest. Every read that feeds attention takes that checksum and size and verifies them while
reading; nothing read becomes visible before the whole file has verified. The container itself
carries none (version 1 carried a second, payload-only checksum: one payload was hashed twice on
every write).

Writing is the store's job: `pack` returns the file as a list of buffers (header, padding, the
arrays' own memory) that a writer hands to writev without assembling a copy. This module reads a
file whole (`read_verified`, `unpack`) or a few unverified rows (`read_rows`); reading one on a
background thread while its caller uses what has arrived is backends/section_reader.py's, which
builds on the header and section parsing here (`parse_header`, `header_end`, `section_table`).

Dependency rules: numpy, msgpack and xxhash only; knows nothing of blocks, models or contextd.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "IO_CHUNK_BYTES",
    "ContainerError",
    "Section",
    "checksum",
    "header_end",
    "open_sized",
    "pack",
    "parse_header",
    "read_rows",
    "read_verified",
    "section_table",
    "unpack",
]

FORMAT_VERSION = 2
_ALIGN = 64
_PREFIX = struct.Struct("<8sHHI")

# Cold reads in 64 KiB requests let kernel readahead run ahead of the copy (one request for a whole
# 6 MB block was slower on a virtio disk: docs/journal/2026-11-29-restore-path.md), and hashing each
# request right after it lands hits the CPU cache instead of reading the whole payload back from
# memory.
IO_CHUNK_BYTES = 64 * 1024


class ContainerError(ValueError):
    """Bytes that are not a well-formed container of this format version, or that fail their
    checksum; the backends raise it as BlockFormatError."""


def checksum(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of a whole payload file as 32 lowercase hex digits (the manifest's checksum)."""
    return xxhash.xxh3_128_hexdigest(data)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


CODEC = "shuffle-zstd"
_ZSTD_LEVEL = 1  # level 3 compressed no better on K/V and took longer (docs/journal/2026-11-30-scale.md)


def _shuffle(row: np.ndarray) -> bytes:
    """A row's bytes as planes: byte 0 of every element, then byte 1, ..."""
    return np.ascontiguousarray(row.reshape(-1).view(np.uint8).reshape(-1, row.dtype.itemsize).T).tobytes()


def _unshuffle(planes: bytes, dtype: np.dtype[Any], shape: list[int]) -> np.ndarray:
    raw = np.frombuffer(planes, dtype=np.uint8).reshape(dtype.itemsize, -1)
    row: np.ndarray = np.ascontiguousarray(raw.T).view(dtype).reshape(shape)
    return row


def pack(magic: bytes, meta: dict[str, Any], sections: list[tuple[str, np.ndarray]],
         compress: frozenset[str] = frozenset()) -> list[memoryview]:
    """The container as a list of buffers; joining them gives the file's bytes. Sections named
    in `compress` are stored with the shuffle-zstd codec, one frame per row along axis 0."""
    table: list[list[Any]] = []
    payload: list[memoryview] = []
    offset = 0
    for name, arr in sections:
        le = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        if name in compress and le.ndim:
            import zstandard

            packer = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
            frames = [packer.compress(_shuffle(row)) for row in le]
            stored = sum(len(f) for f in frames)
            starts = np.cumsum([0] + [len(f) for f in frames[:-1]]).tolist()
            table.append([name, le.dtype.str, list(le.shape), offset, stored, CODEC,
                          [[int(s), len(f)] for s, f in zip(starts, frames, strict=True)]])
            pieces = [memoryview(f) for f in frames]
            nbytes = stored
        else:
            table.append([name, le.dtype.str, list(le.shape), offset, int(le.nbytes)])
            pieces = [le.reshape(-1).view(np.uint8).data]
            nbytes = int(le.nbytes)
        pad = memoryview(bytes(_align(offset + nbytes) - offset - nbytes))
        payload.extend(piece for piece in (*pieces, pad) if len(piece))
        offset = _align(offset + nbytes)
    header = dict(meta)
    header["sections"] = table
    header["payload_len"] = offset
    hbytes = msgpack.packb(header, use_bin_type=True)
    head = _PREFIX.pack(magic, FORMAT_VERSION, 0, len(hbytes)) + hbytes
    return [memoryview(head + bytes(_align(len(head)) - len(head))), *payload]


def parse_header(magic: bytes, mv: memoryview) -> tuple[dict[str, Any], int]:
    """Decode the prefix and msgpack header at the start of `mv`; return it and the payload offset."""
    if len(mv) < _PREFIX.size:
        raise ContainerError(f"{len(mv)} bytes is too short for a header")
    got_magic, version, _flags, hlen = _PREFIX.unpack_from(mv, 0)
    if got_magic != magic:
        raise ContainerError(f"bad magic {got_magic!r}, expected {magic!r}")
    if version != FORMAT_VERSION:
        raise ContainerError(f"format version {version} is not supported (this build reads {FORMAT_VERSION})")
    if _PREFIX.size + hlen > len(mv):
        raise ContainerError("truncated header")
    try:
        header = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + hlen], raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise ContainerError(f"header does not decode: {e}") from None
    if not isinstance(header, dict):
        raise ContainerError("header is not a map")
    return header, _align(_PREFIX.size + hlen)


def header_end(head: bytes | memoryview) -> int | None:
    """Where the payload of a file beginning with `head` starts (its header's end, padded), read
    off the fixed prefix alone; None while `head` is shorter than the prefix."""
    if len(head) < _PREFIX.size:
        return None
    end: int = _align(_PREFIX.size + _PREFIX.unpack_from(head, 0)[3])
    return end


@dataclass(frozen=True)
class Section:
    """One section's place in the payload; `frames` (offset, size) per row when compressed."""

    name: str
    dtype: np.dtype[Any]
    shape: list[int]
    offset: int
    nbytes: int
    frames: list[tuple[int, int]] | None

    def rows_end(self, rows: int) -> int:
        """Payload offset at which the first `rows` rows are all stored."""
        if self.frames is None:
            per_row = self.nbytes // max(1, self.shape[0]) if self.shape else self.nbytes
            return self.offset + per_row * rows
        if rows == 0:
            return self.offset
        start, size = self.frames[rows - 1]
        return self.offset + start + size

    def view(self, payload: memoryview) -> np.ndarray:
        """The section's array over `payload` (zero-copy; decoded when compressed)."""
        if self.frames is None:
            count = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
            return np.frombuffer(payload, dtype=self.dtype, count=count, offset=self.offset).reshape(self.shape)
        return self.rows(payload, 0, self.shape[0])

    def rows(self, payload: memoryview, start: int, stop: int) -> np.ndarray:
        if self.frames is None:
            return self.view(payload)[start:stop]
        import zstandard

        unpacker = zstandard.ZstdDecompressor()
        row_shape = self.shape[1:]
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        out = np.empty([stop - start, *row_shape], dtype=self.dtype)
        for n in range(start, stop):
            frame_start, size = self.frames[n]
            begin = self.offset + frame_start
            try:
                planes = unpacker.decompress(payload[begin:begin + size], max_output_size=row_bytes)
            except zstandard.ZstdError as e:
                raise ContainerError(f"section {self.name!r} row {n} does not decompress: {e}") from None
            if len(planes) != row_bytes:
                raise ContainerError(f"section {self.name!r} row {n} decompresses to {len(planes)} bytes")
            out[n - start] = _unshuffle(planes, self.dtype, row_shape)
        return out


def section_table(header: dict[str, Any]) -> dict[str, Section]:
    """The header's sections, each checked against the payload's length and layout."""
    payload_len = int(header.get("payload_len", -1))
    table: dict[str, Section] = {}
    for entry in header.get("sections", []):
        try:
            name, dt, shape, off, nbytes = entry[:5]
            dtype = np.dtype(dt)
            shape = [int(d) for d in shape]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            frames = None
            if len(entry) > 5:
                if entry[5] != CODEC or not shape:
                    raise ValueError(f"codec {entry[5]!r} is not supported (this build reads {CODEC!r})")
                frames = [(int(a), int(b)) for a, b in entry[6]]
                if len(frames) != shape[0] or any(a < 0 or b < 0 or a + b > nbytes for a, b in frames):
                    raise ValueError("frames do not match the section")
        except (TypeError, ValueError, IndexError) as e:
            raise ContainerError(f"bad section entry {entry!r}: {e}") from None
        little = dtype == dtype.newbyteorder("<")
        plain_ok = frames is not None or count * dtype.itemsize == nbytes
        if not little or not plain_ok or off < 0 or off + nbytes > payload_len:
            raise ContainerError(f"section {name!r} is inconsistent with the payload")
        table[str(name)] = Section(str(name), dtype, shape, int(off), int(nbytes), frames)
    return table


def _sections(header: dict[str, Any], payload: memoryview) -> dict[str, np.ndarray]:
    """Arrays over `payload` for every section the header lists (zero-copy unless compressed)."""
    return {name: section.view(payload) for name, section in section_table(header).items()}


def unpack(magic: bytes, data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Header and zero-copy section arrays of a whole container (bytes already verified or in memory)."""
    mv = memoryview(data).cast("B")
    header, start = parse_header(magic, mv)
    payload_len = int(header.get("payload_len", -1))
    if payload_len < 0 or start + payload_len != len(mv):
        raise ContainerError(f"payload length mismatch: header says {payload_len}, "
                             f"{len(mv) - start} bytes follow the header")
    return header, _sections(header, mv[start:])


def open_sized(path: str | os.PathLike[str], size: int) -> Any:
    """`path` opened unbuffered; ContainerError (the file closed again) unless it has `size` bytes."""
    f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise ContainerError(f"{os.fspath(path)} has {actual} bytes, the manifest says {size}")
    return f


def read_verified(path: str | os.PathLike[str], expected_checksum: str, size: int) -> memoryview:
    """The whole file, hashed while reading; ContainerError unless size and checksum match."""
    with open_sized(path, size) as f:
        # Uninitialised: every byte is overwritten, and zero-filling a block's buffer first cost
        # time for nothing (docs/journal/2026-11-29-restore-path.md).
        view = np.empty(size, dtype=np.uint8).data
        hasher = xxhash.xxh3_128()
        got = 0
        while got < size:
            n = f.readinto(view[got:got + IO_CHUNK_BYTES])
            if not n:
                raise ContainerError(f"{os.fspath(path)}: file shrank while reading")
            hasher.update(view[got:got + n])
            got += n
    if hasher.hexdigest() != expected_checksum:
        raise ContainerError(f"{os.fspath(path)}: checksum mismatch (corrupted payload)")
    return view


def read_rows(path: str | os.PathLike[str], magic: bytes, section: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) along axis 0 of one section, read with one positioned read and NOT
    verified (the checksum covers the whole file): for derived data such as a selector's index,
    which a corrupt row can only mislead, never for what goes into attention."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(IO_CHUNK_BYTES)
        need = header_end(head)
        if need is not None and need > len(head):
            head += f.read(need - len(head))
        header, payload_start = parse_header(magic, memoryview(head))
        found = section_table(header).get(section)
        if found is None:
            raise ContainerError(f"{os.fspath(path)} has no section {section!r}")
        if not found.shape or not 0 <= start <= stop <= found.shape[0]:
            raise ContainerError(f"rows [{start}, {stop}) are outside section {section!r} of shape {found.shape}")
        first = found.rows_end(start)
        data = os.pread(f.fileno(), found.rows_end(stop) - first, payload_start + first)
    if len(data) != found.rows_end(stop) - first:
        raise ContainerError(f"{os.fspath(path)} is shorter than its header says")
    if found.frames is None:
        rows: np.ndarray = np.frombuffer(data, dtype=found.dtype).reshape([stop - start, *found.shape[1:]])
        return rows
    # The bytes read stand for the payload from `first` on: frame offsets shift by as much.
    local = Section(found.name, found.dtype, found.shape, found.offset - first, found.nbytes, found.frames)
    return local.rows(memoryview(data), start, stop)
