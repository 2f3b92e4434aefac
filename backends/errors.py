"""The errors a backend raises on purpose, one hierarchy under `BackendError`.

Every module of the room raises these, and serving tells them apart by type (a corrupt page from
a configuration error, a model that cannot be served from a runtime that is missing), so they sit
below everything else: the canonical forms (backends/blocks.py), the protocol, the model sources
and both runtimes import them from here.

Dependency rules: none; imports nothing.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BlockFormatError",
    "BlockMismatchError",
    "CorruptPayloadError",
    "UnsupportedModelError",
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
