"""The blob pool: content-addressed block files of one fingerprint.

``blobs/<first 2 hex>/<64 hex blake3>``. A name says what the bytes must be,
so writing the same block twice is harmless and a reader can always tell a
damaged file from a good one. The pool knows nothing of references: the index
counts them and the store decides what may be deleted.

``BlobPool`` is the protocol every backend meets (shaped by what an
S3-compatible object store can do: conditional create, ranged get, stat,
delete, list by prefix); ``LocalPool`` is the one on a local filesystem.
docs/design.md ("Pool protocol") states the semantics.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .errors import BlockMissingError
from .fs import Buffer, FileLayer, refuse_linked, tmp_name

_NAME = re.compile(r"[0-9a-f]{64}")


def is_block_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class BlockFile:
    name: str
    size: int
    mtime: float
    etag: str | None = None  # where the backend has one (an object store's ETag)


@dataclass(frozen=True)
class Layout:
    """How a pool's names map to relative locations, ``<shard>/<leaf>``.

    Blocks shard by their first two hex digits (``ab/ab12…``); headers already
    carry their namespace directory (``<ns dir>/<uuid>.bkv``). The same
    location is a path under a local directory and a key under a bucket prefix,
    so every backend lays a pool out alike."""

    pattern: re.Pattern[str]
    sharded: bool

    def check(self, name: str) -> str:
        if not isinstance(name, str) or self.pattern.fullmatch(name) is None:
            raise ValueError(f"{name!r} is not a name of this pool ({self.pattern.pattern})")
        return name

    def location(self, name: str) -> str:
        return f"{name[:2]}/{name}" if self.sharded else name

    def location_prefix(self, prefix: str) -> str:
        """The location prefix under which every name starting with ``prefix`` lies."""
        return f"{prefix[:2]}/{prefix}" if self.sharded and len(prefix) >= 2 else prefix

    def name_of(self, location: str) -> str | None:
        """The name stored at ``location``, or None for anything not of our shape."""
        shard, _, leaf = location.partition("/")
        name = leaf if self.sharded else location
        if self.sharded and leaf[:2] != shard:
            return None
        return name if self.pattern.fullmatch(name) else None


BLOCK_LAYOUT = Layout(_NAME, sharded=True)


@dataclass(frozen=True)
class Staged:
    """A block written and fsync'd under a tmp name, waiting for ``LocalPool.publish``."""

    tmp: Path
    path: Path
    nbytes: int


@dataclass(frozen=True)
class PoolCapabilities:
    """What a backend can promise; the store picks its write order and sweeps by them."""

    durable_rename: bool  # a put is published by a local atomic rename/link, durable once it returns
    consistent_listing: bool  # a listing shows every finished put and no finished delete
    cheap_stat: bool  # exists/stat are a local syscall, not a network round trip
    range_reads: bool  # get(start, end) transfers only the range
    mtime: bool  # stat reports when the name was last written (sweeps go by age)


@runtime_checkable
class BlobPool(Protocol):
    """Immutable named blobs: what a local directory and an object store both do.

    A name, once created, always holds the same bytes until deleted: there is
    no overwrite. Reads are of whole objects or byte ranges and are never torn:
    a reader gets the bytes of one put or ``BlockMissingError``.
    ``put_if_absent`` and ``get`` check names against the pool's ``layout``
    (ValueError); the rest take names the caller listed or indexed."""

    layout: Layout
    capabilities: PoolCapabilities

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


class LocalPool:
    """A pool in a local directory: ``<directory>/<shard>/<leaf>`` files."""

    capabilities = PoolCapabilities(
        durable_rename=True, consistent_listing=True, cheap_stat=True, range_reads=True, mtime=True
    )

    def __init__(self, directory: Path, fs: FileLayer, layout: Layout = BLOCK_LAYOUT) -> None:
        self.directory = directory
        self._fs = fs
        self.layout = layout

    @property
    def fs(self) -> FileLayer:
        """The file layer every file of the pool goes through."""
        return self._fs

    def path(self, name: str) -> Path:
        return self.directory / self.layout.location(name)

    def create_shards(self) -> None:
        """Make every shard directory (``00`` … ``ff``) that is missing, with one
        fsync of the pool directory. Otherwise a store's first block in a shard
        pays a mkdir and that fsync on its write path: one per block in a young
        root, where almost every block opens a shard of its own."""
        if not self.layout.sharded:
            return
        refuse_linked(self.directory)
        created = False
        try:
            for d in (self.directory / f"{i:02x}" for i in range(256)):
                if not d.is_dir():
                    try:
                        self._fs.mkdir(d)
                        created = True
                    except FileExistsError:
                        continue  # another process made it, or a stray file of that name: left as it is
        except OSError:
            pass  # a full disk must not stop an open: the rest are made on first use (``stage``)
        if created:  # durable before any block is published into one
            self._fs.fsync_dir(self.directory)

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def write(self, name: str, parts: Sequence[Buffer], *, tag: str = "") -> int:
        """Publish a block durably (tmp → fsync → rename → fsync dir); ``tag``
        names the writer in the temp file's name (writers.py)."""
        path = self.path(name)
        refuse_linked(path.parent)
        self._fs.makedirs(path.parent)
        return self._fs.write_atomic(path, parts, tag=tag)

    def stage(self, name: str, parts: Sequence[Buffer], *, tag: str = "") -> Staged:
        """Write a block to a durable tmp file; nothing can see it until ``publish``."""
        path = self.path(name)
        refuse_linked(path.parent)
        self._fs.makedirs(path.parent)
        tmp, nbytes = self._fs.write_tmp(path, parts, tag=tag)
        return Staged(tmp, path, nbytes)

    def publish(self, staged: Sequence[Staged]) -> int:
        """Give staged blocks their names, durably and as one batch (every rename,
        then one fsync per shard directory); on failure the ones not yet renamed
        are removed. Returns the bytes written."""
        try:
            self._fs.publish([(s.tmp, s.path) for s in staged])
        except BaseException:
            self.unstage(staged)
            raise
        return sum(s.nbytes for s in staged)

    def unstage(self, staged: Sequence[Staged]) -> None:
        """Remove staged tmp files that were not published."""
        for s in staged:
            self._fs.unlink_tmp(s.tmp)

    def read(self, name: str) -> bytes:
        try:
            return self._fs.read(self.path(name))
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

    def read_exact(self, name: str, buffers: Sequence[memoryview],
                   on_read: Callable[[Sequence[memoryview]], None] | None = None) -> bool:
        """The restore's fast path (FileLayer.read_exact)."""
        try:
            return self._fs.read_exact(self.path(name), buffers, on_read)
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

    def read_into(self, name: str, buffer: bytearray) -> memoryview:
        """The protocol's whole-object read, into ``buffer`` when it fits (never resized)."""
        data = self.read(name)
        if len(data) > len(buffer):
            return memoryview(data)
        view = memoryview(buffer)[: len(data)]
        view[:] = data
        return view

    def delete(self, name: str) -> None:
        path = self.path(name)
        if path.parent.is_symlink():
            return  # not ours: the listing never saw what is behind a linked shard
        try:
            self._fs.unlink(path)
        except FileNotFoundError:
            pass

    def names(self) -> set[str]:
        """Names of every finished block file, from directory listings alone (no stat)."""
        return {f.name for shard, f in self._fs.shard_files(self.directory)
                if f.name[:2] == shard and is_block_name(f.name)}

    def stat(self, name: str) -> BlockFile:
        st = os.stat(self.path(name))
        return BlockFile(name, st.st_size, st.st_mtime)

    def files(self) -> Iterator[BlockFile]:
        """Every finished block file (never tmp files, never anything not named like a block)."""
        for shard, f in self._fs.shard_files(self.directory):
            if f.name[:2] == shard and is_block_name(f.name):
                st = f.stat(follow_symlinks=False)
                yield BlockFile(f.name, st.st_size, st.st_mtime)

    # -- the BlobPool protocol (beyond the methods above) ---------------------
    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Stage a durable tmp file, then publish it by ``link``, which fails if
        the name exists: of racing writers exactly one creates (a rename would
        let each replace the other and every one report a create)."""
        path = self.path(self.layout.check(name))
        if path.is_file():
            return False
        self._fs.makedirs(path.parent)
        staged = tmp_name(path)
        self._fs.write_atomic(staged, parts, sync_dir=False)
        try:
            self._fs.link(staged, path)
        except FileExistsError:
            return False
        finally:
            self._fs.unlink(staged)
        self._fs.fsync_dir(path.parent)
        return True

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        path = self.path(self.layout.check(name))
        if start == 0 and end is None:
            return self.read(name)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                stop = size if end is None else min(end, size)
                return os.pread(f.fileno(), stop - start, start) if start < stop else b""
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in the pool") from None

    def list_prefix(self, prefix: str = "") -> Iterator[str]:
        for shard, f in self._fs.shard_files(self.directory):
            name = self.layout.name_of(f"{shard}/{f.name}")
            if name is not None and name.startswith(prefix):
                yield name
