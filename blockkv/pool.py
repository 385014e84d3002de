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
from .fs import Buffer, FileLayer, refuse_linked

_NAME = re.compile(r"[0-9a-f]{64}")


def is_block_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class BlockFile:
    name: str
    size: int
    mtime: float


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
        refuse_linked(path.parent)
        self._fs.makedirs(path.parent)
        return self._fs.write_atomic(path, parts)

    def read(self, name: str) -> bytes:
        try:
            return self._fs.read(self.path(name))
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

    def read_into(self, name: str, buffer: bytearray) -> memoryview:
        try:
            return self._fs.read_into(self.path(name), buffer)
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None

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

    def freshen(self, name: str) -> None:
        """Bump a reused block's mtime (git's freshen): orphan sweeps go by age."""
        try:
            os.utime(self.path(name))
        except OSError:
            pass
