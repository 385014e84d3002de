"""check and repair: compare what the files say with what the index says.

The files are the truth. ``inspect`` reads every header and verifies every
block hash without changing anything (restic ``check``, git ``fsck``), so a
tool can report on a directory it has not opened as a store; ``repair``
acts on the findings (the caller holds the directory lock and rebuilds the
index afterwards).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptError, NewerFormatError
from blockkv.format.blocks import block_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import decode_block
from blockkv.local import writers
from blockkv.local.directory import Directory
from blockkv.local.index import BlockRow, read_only_block_rows
from blockkv.local.locks import DirLock

Progress = Callable[[int, int], None]


@dataclass
class CheckReport:
    """What ``check`` found; ``actions`` is what a repair did about it."""

    entries: int = 0
    blocks: int = 0
    dangling: list[str] = field(default_factory=list)  # entry ids with a block missing or corrupt
    orphan_blocks: list[str] = field(default_factory=list)  # block files nothing references
    refcount_mismatches: list[tuple[str, int, int]] = field(default_factory=list)  # (name, index, truth)
    corrupt_headers: list[str] = field(default_factory=list)  # paths relative to the fingerprint dir
    corrupt_blocks: list[str] = field(default_factory=list)
    foreign_headers: list[str] = field(default_factory=list)  # another identity's: kept, never served
    newer_headers: list[str] = field(default_factory=list)  # a newer blockkv's format: kept, never served
    unreadable: list[str] = field(default_factory=list)  # headers and blocks a transient error kept us from reading
    stale_tmp: list[str] = field(default_factory=list)  # temp files of dead writers (relative paths)
    in_flight: list[str] = field(default_factory=list)  # blocks of stores in progress: not findings
    index_missing: bool = False
    actions: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.dangling or self.orphan_blocks or self.refcount_mismatches
                    or self.corrupt_headers or self.corrupt_blocks or self.stale_tmp or self.index_missing
                    or self.unreadable or self.newer_headers)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "clean": self.clean}


Keys = dict[str, "bytes | None"]  # block name -> the key its referencing header names it with
Verified = tuple[dict[str, bool], list[str]]  # block -> corrupt?, and the blocks that could not be read


def block_keys(directory: Directory) -> Keys:
    """The key of every block some readable header references (None: not keyed).
    Headers that do not read are left out here; ``inspect`` reports them."""
    keys: Keys = {}
    for p in directory.listing().headers.values():
        try:
            header = directory.read_header(Path(p))
        except Exception:  # noqa: BLE001 - reported by inspect, which reads every header again
            continue
        key = block_key(header.identity, header.ns)
        keys.update((r.name, key) for r in blocks_for_prefix(header.descriptor, None))
    return keys


def _verify(name: str, data: bytes, keys: Keys) -> None:
    """Check a block's frame and, when a header names it, its hash under that
    header's key; a block no header references has no known key (isolation
    keys blocks by namespace), so only its frame is checked."""
    if name in keys:
        decode_block(name, data, key=keys[name])
    else:
        decode_block(name, data, verify=False)


def _verdict(directory: Directory, name: str, keys: dict[str, bytes | None]) -> bool | None:
    """Whether one block file is corrupt; None if it is gone. Any other error
    (EMFILE, EIO, MemoryError) is raised: it proves nothing about the block."""
    try:
        _verify(name, directory.pool.read(name), keys)
        return False
    except CorruptBlockError:
        return True
    except BlockMissingError:
        return None


def verify_blocks(directory: Directory, progress: Progress | None = None) -> Verified:
    """Hash every block file: name → whether it is corrupt, and the blocks a
    transient error kept us from reading (never corrupt). The slow part of a
    check, so it runs without the directory lock (a block deleted meanwhile is
    left out; one written meanwhile is verified by ``inspect``)."""
    keys = block_keys(directory)
    names = sorted(directory.pool.names())
    out: dict[str, bool] = {}
    unreadable: list[str] = []
    for done, name in enumerate(names, 1):
        try:
            bad = _verdict(directory, name, keys)
        except Exception:  # noqa: BLE001 - EMFILE, EIO, MemoryError: not proof of corruption
            unreadable.append(name)
        else:
            if bad is not None:
                out[name] = bad
        if progress is not None:
            progress(done, len(names))
    return out, unreadable


def inspect(directory: Directory, rows: dict[str, BlockRow] | None,
            progress: Progress | None = None, *, verified: Verified | None = None,
            tmp_cutoff: float | None = None) -> CheckReport:
    """Findings for ``directory`` against index rows ``rows`` (None: no usable index).

    Meant to run under the directory lock, so no store is between taking its
    references and making its entry visible: what it reads is consistent.
    ``verified``: block hashes already checked (``verify_blocks``); the rest
    are hashed here. Blocks live writers announced (writers.py) are in flight,
    not orphans; the writers are surveyed *after* the listing, so every listed
    block a live writer wants was announced by then. ``tmp_cutoff``: a temp
    file without a writer token older than this is stale (default: one
    ``DEFAULT_TMP_GRACE`` ago)."""
    listing = directory.listing()
    live = writers.survey(directory.path / "writers")
    cutoff = time.time() - writers.DEFAULT_TMP_GRACE if tmp_cutoff is None else tmp_cutoff
    report = CheckReport(index_missing=rows is None, in_flight=sorted(live.names),
                         stale_tmp=[directory.rel(p) for p in writers.stale_temp_files(listing.tmp, live, cutoff)])
    files = listing.blocks
    truth: Counter[str] = Counter()
    referencing: dict[str, tuple[str, ...]] = {}
    keys: dict[str, bytes | None] = {}  # block -> the key its referencing header names it with
    for entry_id, p in listing.headers.items():
        path = Path(p)
        try:
            header = directory.read_header(path)
            record = directory.record(entry_id, path, header, path.stat().st_size)
        except FileNotFoundError:
            continue  # removed while we looked
        except CorruptError:
            report.corrupt_headers.append(directory.rel(path))
            continue
        except NewerFormatError:
            report.newer_headers.append(directory.rel(path))
            continue
        except Exception:  # noqa: BLE001 - EMFILE, EIO, MemoryError: not proof of corruption
            report.unreadable.append(directory.rel(path))
            continue
        if record.owner != directory.identity.digest():
            report.foreign_headers.append(record.path)
        else:
            report.entries += 1
            referencing[entry_id] = record.blocks
        truth.update(record.blocks)
        key = block_key(header.identity, header.ns)
        keys.update((n, key) for n in record.blocks)
    known, unread = verified or ({}, [])
    rest = {n: known[n] for n in files if n in known}
    fresh = [n for n in sorted(files) if n not in known and n not in unread]
    report.unreadable += [directory.rel(directory.pool.path(n)) for n in unread if n in files]
    for done, name in enumerate(fresh, 1):
        try:
            bad = _verdict(directory, name, keys)
        except Exception:  # noqa: BLE001 - not proof of corruption: neither corrupt nor an orphan
            report.unreadable.append(directory.rel(directory.pool.path(name)))
        else:
            if bad is None:
                files.discard(name)
            else:
                rest[name] = bad
        if progress is not None and verified is None:
            progress(done, len(fresh))
    corrupt = {n for n, bad in rest.items() if bad and n in files}
    report.blocks = len(files)
    report.corrupt_blocks = sorted(corrupt)
    report.dangling = sorted(
        entry_id for entry_id, needed in referencing.items() if any(n not in files or n in corrupt for n in needed)
    )
    if report.newer_headers or any(u.startswith("entries/") for u in report.unreadable):
        return report  # a header we could not read may reference any block: no orphans, no refcounts
    waiting_for_gc = {n for n, row in (rows or {}).items() if row.refs == 0}
    report.orphan_blocks = sorted(n for n in files if not truth[n] and n not in waiting_for_gc
                                  and n not in live.names)
    if rows is not None:
        report.refcount_mismatches = sorted(
            (n, rows[n].refs if n in rows else 0, truth[n])
            for n in set(rows) | set(truth)
            if (rows[n].refs if n in rows else 0) != truth[n]
        )
    return report


def check_directory(directory: Directory, *, lock_timeout: float | None = None,
                    progress: Progress | None = None) -> CheckReport:
    """``check`` for a tool that has not opened the directory as a store: it
    changes nothing and takes no write lock. Block hashes are checked first
    without any lock; the comparison holds the directory lock *shared*, so no
    store is half-way through and a busy, healthy directory reports clean."""
    verified = verify_blocks(directory, progress)
    lock = DirLock(directory.path / "LOCK", create=False)
    try:
        with lock.held(lock_timeout, shared=True):
            return inspect(directory, read_only_block_rows(directory.index_dir), verified=verified)
    finally:
        lock.close()


def repair(directory: Directory, report: CheckReport) -> None:
    """Act on the findings, in the same hold of the directory lock as
    ``inspect``: unlink corrupt and dangling headers of ours, delete corrupt
    blocks (hashed again first: only proof deletes) and orphan blocks (no live
    writer had announced them), dead writers' temp files and intent files.
    Unreadable files are left alone."""
    keys = block_keys(directory) if report.corrupt_blocks else {}  # before dangling headers go
    for rel in report.corrupt_headers:
        directory.unlink_quietly(directory.path / rel)
        report.actions.append(f"removed corrupt header {rel}")
    paths = directory.listing().headers
    for entry_id in report.dangling:
        if entry_id in paths:
            directory.unlink_quietly(Path(paths[entry_id]))
            report.actions.append(f"removed dangling entry {entry_id}")
    corrupt = []
    for name in report.corrupt_blocks:
        try:
            _verify(name, directory.pool.read(name), keys)
        except CorruptBlockError:
            corrupt.append(name)
        except Exception:  # noqa: BLE001 - gone, or unreadable now: not proof
            continue
    orphans = report.orphan_blocks
    for name in corrupt + orphans:
        directory.pool.delete(name)
    for rel in report.stale_tmp:
        directory.unlink_quietly(directory.path / rel)
    if corrupt:
        report.actions.append(f"deleted {len(corrupt)} corrupt block(s)")
    if orphans:
        report.actions.append(f"deleted {len(orphans)} unreferenced block(s)")
    writers.reap(writers.survey(directory.path / "writers"))
    if report.stale_tmp:
        report.actions.append(f"removed {len(report.stale_tmp)} temp file(s) of dead writers")
    if report.refcount_mismatches:
        report.actions.append(f"fixed {len(report.refcount_mismatches)} refcount(s)")
