"""check and repair: compare what the files say with what the index says.

The files are the truth. ``inspect_directory`` reads every header and verifies every
block hash without changing anything (restic ``check``, git ``fsck``), so a
tool can report on a directory it has not opened as a store; ``repair``
acts on the findings (the caller holds the directory lock and rebuilds the
index afterwards).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from blockkv.errors import BlockMissingError, CorruptError, NewerFormatError, OversizedError
from blockkv.format.blocks import block_naming_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import Judgement, Verdict
from blockkv.local import writers
from blockkv.local.directory import Directory
from blockkv.local.index import BlockRow, read_only_block_rows
from blockkv.local.locks import DirLock
from blockkv.local.verdicts import judge_file
from blockkv.records import CheckReport, EntryRecord

Progress = Callable[[int, int], None]


Keys = dict[str, "list[bytes | None]"]  # block name -> every key a referencing header names it with


Verified = tuple[dict[str, Verdict], list[str]]  # block -> verdict, and the blocks that could not be read


def block_keys(directory: Directory) -> Keys:
    """Every key each block is named with by some readable header (None: not
    keyed). Headers that do not read are left out here; ``inspect_directory`` reports them."""
    keys: Keys = {}
    for p in directory.listing().headers.values():
        try:
            header = directory.read_header(Path(p))
        except Exception:  # noqa: BLE001 - reported by inspect_directory, which reads every header again
            continue
        names = (r.name for r in blocks_for_prefix(header.descriptor, None))
        _add_keys(keys, block_naming_key(header.identity, header.ns), names)
    return keys


def _add_keys(keys: Keys, key: bytes | None, names: Iterable[str]) -> None:
    for name in names:
        known = keys.setdefault(name, [])
        if key not in known:
            known.append(key)


def _corrupt(verdict: Verdict, keys: Keys, name: str) -> bool:
    """Proof that a block is bad: its frame does not decode, or it hashes to
    its name under none of the keys the headers referencing it name it with (a
    header naming it under another namespace's key proves nothing against it).
    A block no header references has no known key (isolation keys blocks by
    namespace): only its frame counts."""
    return verdict.judgement is Judgement.BROKEN or (verdict.judgement is Judgement.UNNAMED and bool(keys.get(name)))


def _verdict(directory: Directory, name: str, keys: Keys) -> Verdict | None:
    """One block file judged under the keys its headers name it with, read no
    further than its own frame allows (``verdicts.judge_file``); None if it is
    gone. Any other error (EMFILE, EIO, MemoryError, OversizedError) is
    raised: it proves nothing about the block."""
    try:
        return judge_file(directory.pool, name, keys.get(name, []))
    except BlockMissingError:
        return None


def verify_blocks(directory: Directory, progress: Progress | None = None) -> Verified:
    """Hash every block file: name → its verdict, and the blocks a transient
    error kept us from reading (never corrupt). The slow part of a check, so it
    runs without the directory lock (a block deleted meanwhile is left out; one
    written meanwhile, found corrupt here or longer than its frame can be, is
    looked at again by ``inspect_directory``, which reports it)."""
    keys = block_keys(directory)
    names = sorted(directory.pool.names())
    out: dict[str, Verdict] = {}
    unreadable: list[str] = []
    for done, name in enumerate(names, 1):
        try:
            verdict = _verdict(directory, name, keys)
        except OversizedError:
            pass  # left to inspect_directory: its size is read again under the lock, no bytes
        except Exception:  # noqa: BLE001 - EMFILE, EIO, MemoryError: not proof of corruption
            unreadable.append(name)
        else:
            if verdict is not None:
                out[name] = verdict
        if progress is not None:
            progress(done, len(names))
    return out, unreadable


@dataclass
class _Read:
    """A header ``inspect_directory`` read: where it is, what it records, the key it names its blocks with."""

    rel: str
    record: EntryRecord
    key: bytes | None
    own: bool


def inspect_directory(directory: Directory, rows: dict[str, BlockRow] | None,
                      progress: Progress | None = None, *, verified: Verified | None = None,
                      tmp_cutoff: float | None = None) -> CheckReport:
    """Findings for ``directory`` against index rows ``rows`` (None: no usable index).

    Meant to run under the directory lock, so no store is between taking its
    references and making its entry visible: what it reads is consistent.
    ``verified``: block hashes already checked (``verify_blocks``), without the
    lock; a verdict of corrupt is never carried over that wait (another handle
    may have quarantined the copy and a store written a good one since), so
    those blocks are hashed again here, with the blocks not hashed yet. A
    header naming a good block under a key it does not verify under (another
    namespace's, under isolation) is a corrupt header; the block stays.
    Blocks live writers announced (writers.py) are in flight,
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
    read, keys = _read_headers(directory, listing.headers, report)
    rest = _judge_blocks(directory, files, keys, verified, report, progress)
    corrupt = {n for n, v in rest.items() if _corrupt(v, keys, n) and n in files}
    truth: Counter[str] = Counter()
    referencing: dict[str, tuple[str, ...]] = {}
    for entry_id, h in read.items():
        if any(n in rest and rest[n].good and rest[n].key != h.key for n in h.record.blocks):
            report.corrupt_headers.append(h.rel)  # it names a good block under a key the block is not named with
            continue
        if h.own:
            report.entries += 1
            referencing[entry_id] = h.record.blocks
        else:
            report.foreign_headers.append(h.rel)
        truth.update(h.record.blocks)
    report.blocks = len(files)
    report.corrupt_blocks = sorted(corrupt)
    report.dangling = sorted(
        entry_id for entry_id, needed in referencing.items() if any(n not in files or n in corrupt for n in needed)
    )
    if report.newer_headers or any(u.startswith("entries/") for u in report.unreadable):
        return report  # a header we could not read may reference any block: no orphans, no refcounts
    report.unreadable += [f"writers/{token}" for token in live.unread]  # may want any block: no orphans
    waiting_for_gc = {n for n, row in (rows or {}).items() if row.refs == 0}
    report.orphan_blocks = sorted(n for n in files if not truth[n] and n not in waiting_for_gc
                                  and n not in live.names) if live.complete else []
    if rows is not None:
        report.refcount_mismatches = sorted(
            (n, rows[n].refs if n in rows else 0, truth[n])
            for n in set(rows) | set(truth)
            if (rows[n].refs if n in rows else 0) != truth[n]
        )
    return report


def _read_headers(directory: Directory, headers: dict[str, str],
                  report: CheckReport) -> tuple[dict[str, _Read], Keys]:
    """Every header that parses, and the keys each block is named with by the
    headers referencing it; the rest reported (corrupt, newer, unreadable)."""
    read: dict[str, _Read] = {}
    keys: Keys = {}  # block -> the keys its referencing headers name it with
    for entry_id, p in headers.items():
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
        key = block_naming_key(header.identity, header.ns)
        read[entry_id] = _Read(record.path, record, key, record.owner in directory.modes)  # of either mode
        _add_keys(keys, key, record.blocks)
    return read, keys


def _judge_blocks(directory: Directory, files: set[str], keys: Keys, verified: Verified | None,
                  report: CheckReport, progress: Progress | None) -> dict[str, Verdict]:
    """Each block file's verdict, hashed here unless ``verified`` already judged
    it good; a block gone meanwhile leaves ``files``, one not read is reported."""
    known, unread = verified or ({}, [])
    rest = {n: known[n] for n in files if n in known}
    fresh = [n for n in sorted(files) if n not in unread and (n not in rest or _corrupt(rest[n], keys, n))]
    report.unreadable += [directory.rel(directory.pool.path(n)) for n in unread if n in files]
    for done, name in enumerate(fresh, 1):
        try:
            verdict = _verdict(directory, name, keys)
        except OversizedError:  # not read, not convicted: an orphan still, if nothing references it
            rest.pop(name, None)
            report.oversized_blocks.append(name)
        except Exception:  # noqa: BLE001 - not proof of corruption: neither corrupt nor an orphan
            rest.pop(name, None)
            report.unreadable.append(directory.rel(directory.pool.path(name)))
        else:
            if verdict is None:
                files.discard(name)
                rest.pop(name, None)
            else:
                rest[name] = verdict
        if progress is not None and verified is None:
            progress(done, len(fresh))
    return rest


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
            return inspect_directory(directory, read_only_block_rows(directory.index_dir), verified=verified)
    finally:
        lock.close()


def repair(directory: Directory, report: CheckReport) -> None:
    """Act on the findings, in the same hold of the directory lock as
    ``inspect_directory``: unlink corrupt and dangling headers of ours, delete corrupt
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
            if _corrupt(judge_file(directory.pool, name, keys.get(name, [])), keys, name):
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
