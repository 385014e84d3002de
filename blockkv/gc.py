"""check and repair: compare what the files say with what the index says.

The files are the truth. ``inspect`` reads every header and verifies every
block hash without changing anything (restic ``check``, git ``fsck``), so a
tool can report on a directory it has not opened as a store; ``repair``
acts on the findings (the caller holds the directory lock and rebuilds the
index afterwards).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import blocks as blk
from .directory import Directory, block_key
from .errors import BlockMissingError, CorruptBlockError, CorruptError
from .index import BlockRow

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
    unreadable: list[str] = field(default_factory=list)  # headers and blocks a transient error kept us from reading
    index_missing: bool = False
    actions: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.dangling or self.orphan_blocks or self.refcount_mismatches
                    or self.corrupt_headers or self.corrupt_blocks or self.index_missing or self.unreadable)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "clean": self.clean}


def inspect(directory: Directory, rows: dict[str, BlockRow] | None,
            progress: Progress | None = None) -> CheckReport:
    """Findings for ``directory`` against index rows ``rows`` (None: no usable index)."""
    report = CheckReport(index_missing=rows is None)
    listing = directory.listing()
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
    corrupt = set()
    names = sorted(files)
    for done, name in enumerate(names, 1):
        try:
            data = directory.pool.read(name)
            if name in keys:
                blk.decode_block(name, data, key=keys[name])
            else:  # no header names it, so its key (if any) is unknown: check the frame only
                blk.decode_block(name, data, verify=False)
        except CorruptBlockError:
            corrupt.add(name)
        except BlockMissingError:
            files.discard(name)
        except Exception:  # noqa: BLE001 - not proof of corruption: neither corrupt nor an orphan
            report.unreadable.append(f"blobs/{name[:2]}/{name}")
        if progress is not None:
            progress(done, len(names))
    report.blocks = len(files)
    report.corrupt_blocks = sorted(corrupt)
    report.dangling = sorted(
        entry_id for entry_id, needed in referencing.items() if any(n not in files or n in corrupt for n in needed)
    )
    if any(u.startswith("entries/") for u in report.unreadable):
        return report  # a header we could not read may reference any block: no orphans, no refcounts
    waiting_for_gc = {n for n, row in (rows or {}).items() if row.refs == 0}
    report.orphan_blocks = sorted(n for n in files if not truth[n] and n not in waiting_for_gc)
    if rows is not None:
        report.refcount_mismatches = sorted(
            (n, rows[n].refs if n in rows else 0, truth[n])
            for n in set(rows) | set(truth)
            if (rows[n].refs if n in rows else 0) != truth[n]
        )
    return report


def repair(directory: Directory, report: CheckReport) -> None:
    """Unlink corrupt and dangling headers of ours, delete corrupt and orphan blocks.
    Unreadable files are left alone: only proof of corruption deletes."""
    for rel in report.corrupt_headers:
        directory.unlink_quietly(directory.path / rel)
        report.actions.append(f"removed corrupt header {rel}")
    paths = directory.listing().headers
    for entry_id in report.dangling:
        if entry_id in paths:
            directory.unlink_quietly(Path(paths[entry_id]))
            report.actions.append(f"removed dangling entry {entry_id}")
    for name in report.corrupt_blocks + report.orphan_blocks:
        directory.pool.delete(name)
    if report.corrupt_blocks:
        report.actions.append(f"deleted {len(report.corrupt_blocks)} corrupt block(s)")
    if report.orphan_blocks:
        report.actions.append(f"deleted {len(report.orphan_blocks)} unreferenced block(s)")
    if report.refcount_mismatches:
        report.actions.append(f"fixed {len(report.refcount_mismatches)} refcount(s)")
