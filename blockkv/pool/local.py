"""``LocalPool``: the blob pool on a local filesystem, ``blobs/<first 2 hex>/<64 hex blake3>``.

Every write and read goes through the ``FileLayer`` (the fault and power-loss seam).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from blockkv.errors import BlockMissingError
from blockkv.format.layout import BLOCK_LAYOUT, Layout, is_block_name
from blockkv.fs import Buffer, FileLayer, refuse_linked, tmp_name
from blockkv.pool.protocol import BlockFile, Staged, check_range


class LocalPool:
    """A pool in a local directory: ``<directory>/<shard>/<leaf>`` files."""

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
        """Write a block to a tmp file, durable once ``publish`` returns; nothing can see it until then."""
        path = self.path(name)
        refuse_linked(path.parent)
        self._fs.makedirs(path.parent)
        tmp, nbytes = self._fs.write_tmp(path, parts, tag=tag, batched=True)
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

    def read(self, name: str, limit: int | None = None) -> bytes:
        """A block file whole; ``OversizedError``, unread, if it is above ``limit`` bytes."""
        try:
            return self._fs.read(self.path(name), limit)
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

    def read_head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of a block file (all of it if it is shorter)."""
        try:
            return self._fs.read_head(self.path(name), n)
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
