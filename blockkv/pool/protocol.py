"""The blob pool protocol: content-addressed files, named by what their bytes must be.

A name says what the bytes must be, so writing the same block twice is
harmless and a reader can always tell a damaged file from a good one. A pool
knows nothing of references: the index counts them and the store decides
what may be deleted.

``BlobPool`` is the protocol every backend meets (shaped by what an
S3-compatible object store can do: conditional create, ranged get, stat,
delete, list by prefix): ``local.LocalPool`` on a local filesystem,
``memory.MemoryPool`` in memory, ``s3.S3Pool`` on a bucket.
docs/design.md ("Pool protocol") states the semantics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from blockkv.format.layout import Layout
from blockkv.fs import Buffer


@dataclass(frozen=True)
class BlockFile:
    name: str
    size: int
    mtime: float
    etag: str | None = None  # where the backend has one (an object store's ETag)


@dataclass(frozen=True)
class Staged:
    """A block written and fsync'd under a tmp name, waiting for ``LocalPool.publish``."""

    tmp: Path
    path: Path
    nbytes: int


@runtime_checkable
class BlobPool(Protocol):
    """Immutable named blobs: what a local directory and an object store both do.

    A name, once created, always holds the same bytes until deleted: there is
    no overwrite. Reads are of whole objects or byte ranges and are never torn:
    a reader gets the bytes of one put or ``BlockMissingError``.
    ``put_if_absent`` and ``get`` check names against the pool's ``layout``
    (ValueError); the rest take names the caller listed or indexed."""

    layout: Layout

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Create ``name`` from ``parts`` (concatenated) unless it exists.
        True if this call created it; False if the name was already there (its
        bytes are left as they were: for a content-addressed name, a dedup hit)."""
        ...

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` clipped to the object, like a slice; BlockMissingError if absent."""
        ...

    def read_into(self, name: str, buffer: bytearray) -> memoryview:
        """The whole object, in ``buffer`` when it fits (never resized), else in fresh memory."""
        ...

    def exists(self, name: str) -> bool: ...

    def stat(self, name: str) -> BlockFile:
        """Size, mtime and etag where the backend has one; FileNotFoundError if absent."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name``; nothing if it is already gone."""
        ...

    def list_prefix(self, prefix: str = "") -> Iterator[str]:
        """Names starting with ``prefix``, in no particular order (no stat)."""
        ...


def check_range(start: int, end: int | None) -> None:
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"byte range [{start}, {end}) is not a range")


