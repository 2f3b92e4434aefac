"""The container format of blocks and recurrent snapshots, and its verified reads.

    offset 0   8 bytes   magic (b"KVEBLOCK" or b"KVESNAP\\0")
    offset 8   u16 LE    format version (2)
    offset 10  u16 LE    flags (0)
    offset 12  u32 LE    header length H
    offset 16  H bytes   msgpack map: metadata + "sections" + "payload_len"
    then zero padding to a multiple of 64; the payload starts there
    payload    sections in header order, each at a 64-byte aligned offset (relative to payload
               start), C-order little-endian raw bytes, zero padding between sections

A stored payload has exactly one checksum: xxh3-128 of the whole file, 32 lowercase hex digits,
computed by the canonical store while it writes the file (contextd.blobs) and recorded in the
manifest. Every read here takes that checksum and size and verifies them while reading; nothing
read becomes visible before the whole file has verified. The container itself carries none
(version 1 carried a second, payload-only checksum: one payload was hashed twice on every write).

Writing is the store's job: `pack` returns the file as a list of buffers (header, padding, the
arrays' own memory) that a writer hands to writev without assembling a copy.

Dependency rules: numpy, msgpack and xxhash only; knows nothing of blocks, models or contextd.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any

import msgpack
import numpy as np
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "IO_CHUNK_BYTES",
    "ContainerError",
    "SectionReader",
    "checksum",
    "pack",
    "read_verified",
    "unpack",
]

FORMAT_VERSION = 2
_ALIGN = 64
_PREFIX = struct.Struct("<8sHHI")

# Cold reads in 64 KiB requests let kernel readahead run ahead of the copy (one request for a whole
# 6 MB block was ~40% slower on a virtio disk), and hashing each request right after it lands hits
# the CPU cache instead of reading the whole payload back from memory.
IO_CHUNK_BYTES = 64 * 1024
# Copies out of the page cache have no readahead to keep ahead of: bigger requests, fewer calls.
_CACHED_CHUNK_BYTES = 1024 * 1024


class ContainerError(ValueError):
    """Bytes that are not a well-formed container of this format version, or that fail their
    checksum; the backends raise it as BlockFormatError."""


def checksum(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of a whole payload file as 32 lowercase hex digits (the manifest's checksum)."""
    return xxhash.xxh3_128_hexdigest(data)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(magic: bytes, meta: dict[str, Any], sections: list[tuple[str, np.ndarray]]) -> list[memoryview]:
    """The container as a list of buffers; joining them gives the file's bytes."""
    table: list[list[Any]] = []
    payload: list[memoryview] = []
    offset = 0
    for name, arr in sections:
        le = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        table.append([name, le.dtype.str, list(le.shape), offset, int(le.nbytes)])
        data = le.reshape(-1).view(np.uint8).data
        pad = memoryview(bytes(_align(offset + le.nbytes) - offset - le.nbytes))
        payload.extend(piece for piece in (data, pad) if len(piece))
        offset = _align(offset + le.nbytes)
    header = dict(meta)
    header["sections"] = table
    header["payload_len"] = offset
    hbytes = msgpack.packb(header, use_bin_type=True)
    head = _PREFIX.pack(magic, FORMAT_VERSION, 0, len(hbytes)) + hbytes
    return [memoryview(head + bytes(_align(len(head)) - len(head))), *payload]


def _parse_header(magic: bytes, mv: memoryview) -> tuple[dict[str, Any], int]:
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
            raise ContainerError(f"bad section entry {entry!r}: {e}") from None
        little = dtype == dtype.newbyteorder("<")
        if not little or count * dtype.itemsize != nbytes or off < 0 or off + nbytes > payload_len:
            raise ContainerError(f"section {name!r} is inconsistent with the payload")
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=off).reshape(shape)
    return arrays


def unpack(magic: bytes, data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Header and zero-copy section arrays of a whole container (bytes already verified or in memory)."""
    mv = memoryview(data).cast("B")
    header, start = _parse_header(magic, mv)
    payload_len = int(header.get("payload_len", -1))
    if payload_len < 0 or start + payload_len != len(mv):
        raise ContainerError(f"payload length mismatch: header says {payload_len}, "
                             f"{len(mv) - start} bytes follow the header")
    return header, _sections(header, mv[start:])


def _open_sized(path: str | os.PathLike[str], size: int) -> Any:
    f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise ContainerError(f"{os.fspath(path)} has {actual} bytes, the manifest says {size}")
    return f


def read_verified(path: str | os.PathLike[str], expected_checksum: str, size: int) -> memoryview:
    """The whole file, hashed while reading; ContainerError unless size and checksum match."""
    with _open_sized(path, size) as f:
        # Uninitialised: every byte is overwritten, and zero-filling 6 MB cost ~0.3 ms per block.
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


class SectionReader:
    """Reads a container file on a background thread so a caller can use the sections that have
    arrived while the rest is still coming from disk (restore = max(read, insert), not the sum).

        with SectionReader(path, MAGIC, checksum, size) as rd:
            rd.wait("positions")          # rd.arrays[...] are views into the buffer being filled
            rd.wait("keys", rows=4)       # the first 4 rows (layers) of keys have arrived
            rd.finish()                   # all read and the checksum verified: only now commit

    The header is read and checked in the constructor. Nothing read may be committed before
    `finish()` returns: until then the checksum is unverified.
    """

    def __init__(self, path: str | os.PathLike[str], magic: bytes, expected_checksum: str, size: int) -> None:
        self._file = _open_sized(path, size)  # closed by close(), also on a failed header
        self._expected = expected_checksum
        try:
            self._size = size
            self._mv = np.empty(size, dtype=np.uint8).data
            self._got = 0
            self._hasher = xxhash.xxh3_128()
            self._fill(min(size, IO_CHUNK_BYTES))
            if self._got >= _PREFIX.size:
                self._fill(min(size, _align(_PREFIX.size + _PREFIX.unpack_from(self._mv, 0)[3])))
            self.header, self._start = _parse_header(magic, self._mv[:self._got])
            payload_len = int(self.header.get("payload_len", -1))
            if payload_len < 0 or self._start + payload_len != size:
                raise ContainerError(f"payload length mismatch: header says {payload_len}, "
                                     f"{size - self._start} bytes follow the header")
            self.arrays = _sections(self.header, self._mv[self._start:])
            self._offsets = {str(e[0]): (int(e[3]), int(e[4])) for e in self.header["sections"]}
        except BaseException:
            self._file.close()
            raise
        self._take_cached()
        self._cond = threading.Condition()
        self._wanted = size
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if self._got < size:
            self._file.seek(self._got)
            self._thread = threading.Thread(target=self._run, name="kv-section-reader", daemon=True)
            self._thread.start()

    def _fill(self, upto: int) -> None:
        while self._got < upto:
            n = self._file.readinto(self._mv[self._got:min(upto, self._got + IO_CHUNK_BYTES)])
            if not n:
                raise ContainerError("file is shorter than its header says")
            self._hasher.update(self._mv[self._got:self._got + n])
            self._got += n

    def _take_cached(self) -> None:
        """Copy whatever the page cache already holds without waiting for the disk (RWF_NOWAIT).
        A recently written page is usually all there, and then a reader thread would only add
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
            self._hasher.update(self._mv[self._got:self._got + n])
            self._got += n

    def _run(self) -> None:
        try:
            got = self._got
            while got < self._size and not self._stop:
                n = self._file.readinto(self._mv[got:got + IO_CHUNK_BYTES])
                if not n:
                    raise ContainerError("file shrank while reading")
                self._hasher.update(self._mv[got:got + n])
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

    def finish(self) -> None:
        """Wait for the whole file and verify its checksum."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._hasher.hexdigest() != self._expected:
            raise ContainerError("checksum mismatch (corrupted payload)")

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        self._file.close()

    def __enter__(self) -> SectionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
