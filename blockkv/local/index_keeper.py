"""One store handle's index, kept trustworthy: the mechanism behind ``scan``
and behind every mutation's "is the index I hold still the one on disk?".

``IndexKeeper`` opens the LMDB environment (moving a broken one aside and
rebuilding it), holds the directory lock for mutations, notices an index
replaced under the handle (an operator deleted it, another process's rebuild
moved it aside) and reopens and recovers it under that lock, and replays the
index's change log into the catalog. It runs the steps of ``Recovery`` in
order and hands back what the store must act on: the stores that died after
their header landed, whose rules and cap are the store's to apply. ``refresh``
(before a query) only flags an index it finds replaced; the next ``locked``
reopens and recovers it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from blockkv.errors import CorruptError
from blockkv.local import writers
from blockkv.local.catalog import Catalog
from blockkv.local.directory import Directory
from blockkv.local.index import Index
from blockkv.local.lmdb_env import BROKEN_INDEX
from blockkv.local.locks import DirLock
from blockkv.local.recovery import Recovery
from blockkv.records import EntryRecord


class IndexKeeper:
    def __init__(self, directory: Directory, lock: DirLock, recovery: Recovery, catalog: Catalog,
                 intents_dir: Path, *, map_size: int, lock_timeout: float,
                 warn: Callable[[str, str], None]) -> None:
        """Open the index; one liblmdb proves broken is rebuilt under the lock (``LockTimeout`` if busy)."""
        self._dir = directory
        self._lock = lock
        self._recovery = recovery
        self._catalog = catalog
        self._intents_dir = intents_dir
        self._map_size = map_size
        self._warn = warn
        self._needs_recovery = False  # an index replaced, or an open that could not lock: recover under the lock
        try:
            self.index = Index(directory.index_dir, map_size=map_size)
        except BROKEN_INDEX as exc:
            with lock.held(lock_timeout):
                self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
                self.index = recovery.fresh_index()

    def close(self) -> None:
        self.index.close()
        self._lock.close()

    def defer_recovery(self) -> None:
        """Open could not take the lock: serve the index as it is (if trusted), recover at the first mutation."""
        self._needs_recovery = True
        if self.index.is_trusted():
            self._catalog.load(self.index)

    @contextmanager
    def locked(self, timeout: float, gc_grace: float, *, recover: bool = False) -> Iterator[list[str]]:
        """The directory lock (``LockTimeout`` after ``timeout``), with the index
        checked current first: one replaced under us is reopened and recovered
        before anything trusts it (``recover``: recover in any case). Yields the
        stores such a recovery found dead after their header landed (indexed now)."""
        with self._lock.held(timeout):
            finished: list[str] = []
            if self._needs_recovery or self.index.replaced():
                finished = self._reopen(gc_grace)
            elif recover:
                finished = self._recover(gc_grace)
            yield finished

    def refresh(self) -> bool:
        """Replay what other handles changed since the catalog last looked
        (cheap when nothing did). False, with one warning, when the index was
        replaced on disk or failed: it must be reopened under the lock first."""
        try:
            if self._needs_recovery or self.index.replaced():
                raise lmdb.Error("the index was replaced on disk")
            self._catalog.apply_changes(self.index)
            return True
        except lmdb.Error as exc:
            self._warn("index", f"LMDB index lost ({exc}); reopening and recovering")
            self._needs_recovery = True
            return False

    def _reopen(self, gc_grace: float) -> list[str]:
        """Under the lock: drop our environment, open what is on disk now, recover."""
        try:
            self.index.close()
        except lmdb.Error:
            pass
        try:
            self.index = Index(self._dir.index_dir, map_size=self._map_size)
        except BROKEN_INDEX as exc:
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self.index = self._recovery.fresh_index()
        finished = self._recover(gc_grace)
        self._needs_recovery = False
        return finished

    def _recover(self, gc_grace: float) -> list[str]:
        """The steps of ``scan``, under the lock, from one listing and one writer survey."""
        finished: list[str] = []
        records: list[EntryRecord] | None = None
        listing = self._dir.listing()  # one listing serves every step below
        live = writers.survey(self._intents_dir)
        self._recovery.reap_tmp(listing.tmp, live)
        files = listing.blocks
        try:
            if self.index.is_trusted():
                records = self.index.entries()
                finished = self._recovery.roll_back_pending(self.index, records)
                if finished:
                    records = self.index.entries()
                if self._recovery.reconcile(self.index, records, listing.headers, files) or finished:
                    records = None  # changed: reload below
            else:
                self._recovery.notes.append("index missing, from another format or from before an OS restart: rebuilt")
                self._recovery.rebuild(self.index)
        except (CorruptError, *BROKEN_INDEX) as exc:
            # a record that does not parse: the tables are garbage but the environment works;
            # liblmdb's proof that the environment itself is broken: it is moved aside first
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self._recovery.notes.append(f"index unreadable ({exc}): rebuilt")
            records = None
            if isinstance(exc, BROKEN_INDEX):
                self.index.close()
                self.index = self._recovery.fresh_index()
            self._recovery.rebuild(self.index)
        self._recovery.sweep_orphans(self.index, gc_grace, files, live)
        self._catalog.load(self.index, records)
        return finished

    def rebuild(self) -> None:
        """Under the lock: the tables thrown away and rebuilt from the header files."""
        self._recovery.rebuild(self.index)
        self._catalog.load(self.index)

    def roll_back_pending(self) -> list[str]:
        """Under the lock, where every ``pending`` record is a dead writer's (a
        live store holds the lock from taking its references to making its
        entry visible): give their references back. Returns the stores whose
        header had landed (indexed now)."""
        if not self.index.pending():
            return []
        finished = self._recovery.roll_back_pending(self.index, self.index.entries())
        self.refresh()
        return finished

    def sweep(self, gc_grace: float) -> int:
        """Under the lock: ``Recovery.sweep_orphans`` on the index we hold."""
        return self._recovery.sweep_orphans(self.index, gc_grace)
