"""Recovery of one fingerprint directory: the mechanism behind ``scan``.

Each step runs under the directory lock and is told which index to work on
(the store swaps its index when one is proven broken): reap the temp files
of dead writers, give back the references of stores that died before their
entry became visible, reconcile the tables with a listing of the files,
rebuild them from the headers, sweep unreferenced blocks. What a step had to
fix is noted in ``notes``; a failure worth a log line goes to the ``warn``
it was given. The store decides which steps run and what follows them.

Only proof of corruption deletes: a header that does not parse, or an entry
of ours whose blocks are gone. A header that cannot be read now is kept, and
while one is unread no orphan block is swept (it may reference them).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Container, Mapping
from pathlib import Path

from blockkv.errors import CorruptError, NewerFormatError
from blockkv.fs import FileLayer
from blockkv.local import writers
from blockkv.local.directory import Directory, stored_at
from blockkv.local.index import Index
from blockkv.records import EntryRecord


class Recovery:
    def __init__(self, directory: Directory, intents_dir: Path, fs: FileLayer, clock: Callable[[], float],
                 owner: str, *, tmp_grace: float, map_size: int, warn: Callable[[str, str], None]) -> None:
        self._dir = directory
        self._pool = directory.pool
        self._intents_dir = intents_dir
        self._fs = fs
        self._clock = clock
        self._owner = owner  # Identity.digest() of the handle: whose entries' blocks must all be there
        self._tmp_grace = tmp_grace
        self._map_size = map_size
        self._warn = warn
        self.notes: list[str] = []  # what recovery had to fix since the store last cleared it
        self._unread_headers: dict[str, str] = {}  # entry id -> header path a transient error kept unindexed

    def _note(self, finding: str) -> None:
        self.notes.append(finding)

    def fresh_index(self) -> Index:
        """Under the lock, on proof that it is broken: move the environment aside
        (never delete it in place: another process may still map it; it notices
        through ``Index.replaced``) and open a fresh one, to be rebuilt."""
        aside = self._dir.index_dir.with_name(f".index-broken-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(self._dir.index_dir, aside)
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
        return Index(self._dir.index_dir, map_size=self._map_size, fs=self._fs)

    def reap_tmp(self, tmp: list[str], live: writers.Writers) -> None:
        """Remove the temp files of dead writers (under the lock). A temp file
        names its writer; one whose writer is alive is never touched, whatever
        the clock says. One without a writer token (an older blockkv) goes by
        age, ``tmp_grace``."""
        for path in writers.stale_temp_files(tmp, live, self._clock() - self._tmp_grace):
            self._dir.unlink_quietly(path)
            self._note(f"reaped write orphan {self._dir.rel(path)}")
        writers.reap(live)

    def _scan_header(self, entry_id: str, path: Path, block_files: Container[str]) -> EntryRecord | None:
        """Index-worthy record of a header file, or None. A corrupt header is
        unlinked (its uuid name in our directory makes it ours); a foreign one
        is kept and counted for its references, never served or deleted. One
        that cannot be read now (EMFILE, EIO, MemoryError...) is not proof of
        anything: it is kept, and until it is indexed no orphan block is swept
        (it may reference them)."""
        try:
            header = self._dir.read_header(path)
            record = self._dir.record(entry_id, path, header, path.stat().st_size)
        except FileNotFoundError:
            self._unread_headers.pop(entry_id, None)
            return None
        except CorruptError as exc:
            self._unread_headers.pop(entry_id, None)
            self._warn("corrupt-header", f"removing corrupt header {path.name}: {exc}")
            self._note(f"removed corrupt header {self._dir.rel(path)}")
            self._dir.unlink_quietly(path)
            return None
        except Exception as exc:  # noqa: BLE001 - transient, or a newer blockkv's: a miss, never a deletion
            self._unread_headers[entry_id] = str(path)
            kind = "newer-header" if isinstance(exc, NewerFormatError) else "unreadable-header"
            self._warn(kind, f"could not read header {path.name} ({exc!r}); kept, not indexed yet")
            self._note(f"could not read header {self._dir.rel(path)} ({exc!r}): kept")
            return None
        self._unread_headers.pop(entry_id, None)
        if record.owner == self._owner and any(n not in block_files for n in record.blocks):
            self._warn("dangling", f"removing entry {entry_id}: some of its blocks are gone")
            self._note(f"removed dangling entry {entry_id}")
            self._dir.unlink_quietly(path)
            return None
        return record

    def rebuild(self, index: Index) -> None:
        """The tables from the header files: each entry's last use is its
        header's mtime (bumped by every restore), its store order (``find``'s
        tie-break) the time its id carries (``stored_at``; the mtime for an
        older blockkv's ids)."""
        sizes = {f.name: f.size for f in self._pool.files()}
        now = self._clock()
        found = []
        for entry_id, p in self._dir.listing().headers.items():
            path = Path(p)
            record = self._scan_header(entry_id, path, sizes)
            if record is not None:
                try:
                    mtime = path.stat().st_mtime
                except FileNotFoundError:
                    continue
                stored = stored_at(entry_id)
                found.append((mtime if stored is None else stored, min(mtime, now), record))
        found.sort(key=lambda f: f[0])
        index.rebuild([(record, used) for _, used, record in found], sizes, now)

    def _last_use(self, path: Path, now: float) -> float:
        """A header's mtime, the last use of its entry (never after ``now``)."""
        try:
            return min(path.stat().st_mtime, now)
        except OSError:
            return now

    def roll_back_pending(self, index: Index, records: list[EntryRecord]) -> list[str]:
        """References taken by a store that died before its entry became visible.
        Returns the entries whose header had landed (indexed now)."""
        finished: list[str] = []
        pending = index.pending()
        if not pending:
            return finished
        now = self._clock()
        known = {r.id for r in records}
        sizes: dict[str, int] | None = None  # the pool's block sizes, listed once if a header landed
        for entry_id, rec in pending.items():
            index.rollback_pending(entry_id, now)
            self._note(f"rolled back the references of an unfinished store ({entry_id})")
            path = self._dir.recorded_header_path(entry_id, rec.get("path") if isinstance(rec, dict) else None)
            if path is None:
                self._note(f"pending record {entry_id[:80]!r} names no header of ours: ignored its path")
            elif entry_id not in known and path.exists():  # header landed, entry never indexed
                if sizes is None:
                    sizes = {f.name: f.size for f in self._pool.files()}
                record = self._scan_header(entry_id, path, sizes)
                if record is not None:
                    index.add_scanned(record, {n: sizes[n] for n in record.blocks}, self._last_use(path, now))
                    finished.append(entry_id)
        return finished

    def reconcile(self, index: Index, known: list[EntryRecord], on_disk: Mapping[str, str], files: set[str]) -> bool:
        """Headers added or removed behind the index's back, and blocks deleted
        behind it, from listings alone. Returns whether anything changed."""
        now = self._clock()
        records = {r.id: r for r in known}
        changed = False
        for entry_id, record in records.items():
            dangling = record.owner == self._owner and any(n not in files for n in record.blocks)
            if entry_id not in on_disk:
                self._note(f"header of entry {entry_id} vanished: dropped")
            elif dangling:
                self._warn("dangling", f"removing entry {entry_id}: its blocks are gone")
                self._note(f"removed dangling entry {entry_id}")
                self._dir.unlink_quietly(Path(on_disk[entry_id]))  # the listing's path: ours by its shape
            else:
                continue
            index.remove_entry(entry_id, now)
            changed = True
        for entry_id, p in on_disk.items():
            if entry_id not in records:
                changed = True
                record = self._scan_header(entry_id, Path(p), files)
                if record is not None:
                    self._note(f"indexed header {self._dir.rel(Path(p))} found on disk")
                    index.add_scanned(record, {n: self._pool.stat(n).size for n in record.blocks},
                                      self._last_use(Path(p), now))
        return changed

    def sweep_orphans(self, index: Index, gc_grace: float, files: set[str] | None = None, live: writers.Writers | None = None) -> int:
        """Under the lock: delete blocks nothing references and no live writer
        may still reference (its intent file names them; none at all while a
        live writer's intents are unread), and the temp files of dead writers.
        ``files``/``live``: a pool listing and writer survey the caller
        already has. A block freed less than ``gc_grace`` ago by this
        clock is kept for reuse; that is policy, not safety (design.md, "Block
        lifetime"), so a block stamped in our future is not kept."""
        if not self._index_unread_headers(index):
            return 0  # a header we could not read may reference any unreferenced block
        listing = self._dir.listing() if files is None else None
        if listing is not None:
            files = listing.blocks
        if live is None:  # surveyed after the listing: a listed block's writer had announced it by then
            live = writers.survey(self._intents_dir)
            if listing is not None:
                self.reap_tmp(listing.tmp, live)
        now = self._clock()
        rows = index.blocks()
        doomed = [name for name, row in rows.items()
                  if row.refs == 0 and not now - gc_grace < row.zero_since <= now]
        doomed += files - rows.keys()
        doomed = [name for name in doomed if name not in live.names] if live.complete else []
        for name in doomed:
            self._fs.crash_point("gc:block-unlinked")
            self._pool.delete(name)
        index.drop_blocks(doomed)
        return len(doomed)

    def _index_unread_headers(self, index: Index) -> bool:
        """Retry the headers a transient error kept out of the index; True once none is left."""
        if not self._unread_headers:
            return True
        sizes = {f.name: f.size for f in self._pool.files()}
        for entry_id, p in list(self._unread_headers.items()):
            record = self._scan_header(entry_id, Path(p), sizes)
            if record is not None and index.entry(entry_id) is None:
                index.add_scanned(record, {n: sizes.get(n, 0) for n in record.blocks},
                                  self._last_use(Path(p), self._clock()))
                self._note(f"indexed header {self._dir.rel(Path(p))} once it could be read")
        if self._unread_headers:
            self._warn("gc-deferred", "not sweeping unreferenced blocks while a header cannot be read")
        return not self._unread_headers
