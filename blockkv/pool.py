"""The blob pool: content-addressed block files of one fingerprint.

``blobs/<first 2 hex>/<64 hex blake3>``. A name says what the bytes must be,
so writing the same block twice is harmless and a reader can always tell a
damaged file from a good one. The pool knows nothing of references: the index
counts them and the store decides what may be deleted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import BlockMissingError
from .fs import Buffer, FileLayer

_NAME = re.compile(r"[0-9a-f]{64}")


def is_block_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class BlockFile:
    name: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Staged:
    """A block written and fsync'd under a tmp name, waiting for ``BlobPool.publish``."""

    tmp: Path
    path: Path
    nbytes: int


class BlobPool:
    def __init__(self, directory: Path, fs: FileLayer) -> None:
        self.directory = directory
        self._fs = fs

    def path(self, name: str) -> Path:
        return self.directory / name[:2] / name

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def write(self, name: str, parts: Sequence[Buffer]) -> int:
        """Publish a block durably (tmp → fsync → rename → fsync dir)."""
        path = self.path(name)
        self._fs.makedirs(path.parent)
        return self._fs.write_atomic(path, parts)

    def stage(self, name: str, parts: Sequence[Buffer]) -> Staged:
        """Write a block to a durable tmp file; nothing can see it until ``publish``."""
        path = self.path(name)
        self._fs.makedirs(path.parent)
        tmp, nbytes = self._fs.write_tmp(path, parts)
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

    def read_exact(self, name: str, buffers: Sequence[memoryview]) -> bool:
        try:
            return self._fs.read_exact(self.path(name), buffers)
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

    def delete(self, name: str) -> None:
        try:
            self._fs.unlink(self.path(name))
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

    def freshen(self, name: str) -> None:
        """Bump a reused block's mtime (git's freshen): orphan sweeps go by age."""
        try:
            os.utime(self.path(name))
        except OSError:
            pass
