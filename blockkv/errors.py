"""Exceptions. Each also subclasses the builtin it resembles, so callers that
catch ``ValueError`` or ``FileNotFoundError`` keep working (zarr's habit).
And ``Warnings``: what a failure that is not raised costs instead."""

from __future__ import annotations

import logging

log = logging.getLogger("blockkv")


class BlockKVError(Exception):
    """Base of every blockkv error."""


class CorruptError(BlockKVError, ValueError):
    """Bytes on disk that do not parse or do not match their checksum."""


class CorruptBlockError(CorruptError):
    """A block whose bytes do not hash to its name, or do not decode."""


class CorruptHeaderError(CorruptError):
    """A header file that fails its checksum or its bounds."""


class NewerFormatError(BlockKVError, ValueError):
    """A header of a later format than this blockkv reads (a newer process
    shares the root). Not proof of corruption: kept, never served, and while
    it is present no orphan block is swept (it may reference any)."""


class BlockMissingError(BlockKVError, FileNotFoundError):
    """A block an entry references is not in the pool (removed by another process)."""


class NotRegularFileError(BlockKVError, FileNotFoundError):
    """Where a file of ours should be, something else: a symlink, FIFO, device
    or directory. Treated as absent: never followed, never read."""


class OversizedError(BlockKVError, ValueError):
    """An object larger than the most its kind can be (a header above the
    format's cap, a block above what its header declares): not read, and not
    proof of anything about the object it should have been. ``etag``: the
    entity tag of the object the store found too large, where it gave one,
    so a conviction names that copy and no later one."""

    def __init__(self, message: str, etag: str = "") -> None:
        super().__init__(message)
        self.etag = etag


class LockTimeout(BlockKVError, TimeoutError):
    """The directory lock was not had within the timeout (a stopped or slow holder)."""


class Warnings:
    """One warning per kind of failure that is not raised: a full disk must not
    flood the log. The bucket's failures (kinds ``remote*``) are counted in
    ``stats["bucket_errors"]``."""

    def __init__(self, stats: dict[str, float]) -> None:
        self._stats = stats
        self._warned: set[str] = set()

    def __call__(self, kind: str, message: str, *, once: bool = True) -> None:
        if kind.startswith("remote"):
            self._stats["bucket_errors"] += 1
        if once and kind in self._warned:
            log.debug("blockkv: %s", message)
            return
        self._warned.add(kind)
        log.warning("blockkv: %s", message)
