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

It also keeps the tables trusted across a reboot (``Index.settle``): a
handle settles them once it has written nothing for ``SETTLE_AFTER``
seconds, and at close. And it writes restores' last uses into the index
under the lock: every write transaction runs under it, so that no write
slips in between a settle's sync and its ``index.settled``. A restore that finds
the lock busy leaves its use with the handle (``used``) until its next
locked operation; the header's mtime already says it (the truth rebuilds read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from blockkv.errors import CorruptError, LockTimeout
from blockkv.local import writers
from blockkv.local.catalog import Catalog
from blockkv.local.directory import Directory
from blockkv.local.index import Index
from blockkv.local.lmdb_env import BROKEN_INDEX
from blockkv.local.locks import DirLock, waiting_at_most
from blockkv.local.recovery import Recovery

SETTLE_AFTER = 5.0  # seconds without an index write before a handle settles the index
REFRESH_WAIT = 0.025  # the longest a query waits for the transaction lock; none after a refresh found it busy
OPEN_WAIT = 2.0  # the longest an open waits for either lock: then it defers its recovery (or, index unopened, fails)
_CLOSE_WAIT = 1.0  # the longest close (or the settler) waits for the locks to settle


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
        self._uses: dict[str, float] = {}  # restores' last uses not yet in the index
        self._uses_mutex = threading.Lock()
        self._settler: threading.Timer | None = None
        self._last_locked = 0.0  # monotonic time the lock was last released
        self._closed = False
        self._busy = False  # the last refresh found the transaction lock busy: the next one does not wait
        self.busy_refreshes = 0  # queries that found the transaction lock busy and served what the catalog knew
        self.busy_waits = 0  # of those, the ones allowed to wait (REFRESH_WAIT at most) before giving up
        try:
            with waiting_at_most(OPEN_WAIT):
                self.index = Index(directory.index_dir, map_size=map_size, fs=directory.fs)
        except BROKEN_INDEX as exc:
            with lock.held(lock_timeout):
                self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
                self.index = recovery.fresh_index()

    def close(self) -> None:
        """Settle the index if the lock comes within a second (else the next
        handle to go idle does), then let go of it."""
        try:
            with waiting_at_most(_CLOSE_WAIT), self._lock.held(_CLOSE_WAIT):
                self._closed = True
                self._write_uses_and_settle()
        except (LockTimeout, OSError, lmdb.Error) as exc:
            self._closed = True
            self._warn("index-settle", f"index not settled at close ({exc})")
        settler, self._settler = self._settler, None
        if settler is not None:
            settler.cancel()
        self.index.close()
        self._lock.close()

    def used(self, entry_id: str, when: float) -> None:
        """A restore's last use, written into the index at the next locked section."""
        with self._uses_mutex:
            self._uses[entry_id] = max(when, self._uses.get(entry_id, when))

    def _write_uses(self) -> None:
        """Under the lock: the last uses ``used`` kept, into the index (kept
        again if the transaction lock was busy)."""
        with self._uses_mutex:
            uses, self._uses = self._uses, {}
        if uses and not self.index.replaced():
            try:
                self.index.touch(uses)
            except LockTimeout:
                for entry_id, when in uses.items():
                    self.used(entry_id, when)
                raise

    def _write_uses_and_settle(self) -> None:
        """Under the lock: the kept last uses into the index, then settle it,
        unless it was replaced on disk (``index.settled`` would then speak for
        tables we have not synced) or still awaits its recovery (tables a
        reboot left unsettled must be recovered, not declared settled)."""
        if self._needs_recovery:
            return
        self._write_uses()
        if not self.index.replaced():
            self.index.settle()

    def _settle_when_idle(self) -> None:
        """The settler's timer: settle once no locked section ran for
        ``SETTLE_AFTER`` seconds; a busy lock or a recent one waits again."""
        self._settler = None
        idle = time.monotonic() - self._last_locked
        if self._closed:
            return
        if idle < SETTLE_AFTER:
            self._arm_settler(SETTLE_AFTER - idle)
            return
        try:
            with waiting_at_most(_CLOSE_WAIT), self._lock.held(0):
                if not self._closed:
                    self._write_uses_and_settle()
        except LockTimeout:
            self._arm_settler(SETTLE_AFTER)
        except (OSError, lmdb.Error) as exc:
            self._warn("index-settle", f"index not settled ({exc}); a reboot will rebuild it")

    def _arm_settler(self, delay: float) -> None:
        if self._settler is None and not self._closed:
            timer = threading.Timer(delay, self._settle_when_idle)
            timer.daemon = True
            self._settler = timer
            timer.start()

    def defer_recovery(self) -> None:
        """Open could not take a lock: serve the index as it is (if trusted),
        recover at the first mutation. A transaction lock still busy leaves
        the catalog to the first refresh that finds it free."""
        self._needs_recovery = True
        try:
            with waiting_at_most(OPEN_WAIT):
                if self.index.is_trusted():
                    self._catalog.load(self.index)
        except LockTimeout:
            self._busy = True

    @contextmanager
    def locked(self, timeout: float, gc_grace: float, *, recover: bool = False) -> Iterator[list[str]]:
        """The directory lock (``LockTimeout`` after ``timeout``), with the index
        checked current first: one replaced under us is reopened and recovered
        before anything trusts it (``recover``: recover in any case). Yields the
        stores such a recovery found dead after their header landed (indexed now)."""
        with self._lock.held(timeout):
            try:
                finished: list[str] = []
                if self._needs_recovery or self.index.replaced():
                    finished = self._reopen(gc_grace)
                elif recover:
                    finished = self._recover(gc_grace)
                self._write_uses()
                yield finished
            finally:
                self._last_locked = time.monotonic()
                if self.index.dirty():
                    self._arm_settler(SETTLE_AFTER)

    def refresh(self) -> bool:
        """Replay what other handles changed since the catalog last looked
        (cheap when nothing did). A query waits at most ``REFRESH_WAIT`` for
        the transaction lock, and not at all while the last refresh found it
        busy: a stopped process costs it one short wait, then none (a
        mutation's refresh, under the directory lock, waits as its
        transactions do: it must see what it wrote). False,
        with one warning, when the index was replaced on disk or failed: it
        must be reopened under the lock first."""
        waited = False
        try:
            if self._needs_recovery or self.index.replaced():
                raise lmdb.Error("the index was replaced on disk")
            if self._lock.held_here():  # a mutation's own refresh: it waits as its transactions do
                self._catalog.apply_changes(self.index)
            else:
                waited = not self._busy
                with waiting_at_most(REFRESH_WAIT if waited else 0.0):
                    self._catalog.apply_changes(self.index)
            self._busy = False
            return True
        except LockTimeout as exc:  # a stopped process inside a transaction: serve what we know
            self.busy_refreshes += 1
            self.busy_waits += waited
            self._busy = True
            self._warn("index-busy", f"LMDB index busy ({exc}); serving the last known state")
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
            self.index = Index(self._dir.index_dir, map_size=self._map_size, fs=self._dir.fs)
        except BROKEN_INDEX as exc:
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self.index = self._recovery.fresh_index()
        finished = self._recover(gc_grace)
        self._needs_recovery = False
        return finished

    def _recover(self, gc_grace: float) -> list[str]:
        """The steps of ``scan``, under the lock, from one listing and one writer survey."""
        finished: list[str] = []
        listing = self._dir.listing()  # one listing serves every step below
        live = writers.survey(self._intents_dir)
        self._recovery.reap_tmp(listing.tmp, live)
        files = listing.blocks
        try:
            if self.index.is_trusted():
                records = self.index.entries(tokens=False)  # the catalog's load reads them, holding none
                finished = self._recovery.roll_back_pending(self.index, records)
                if finished:
                    records = self.index.entries(tokens=False)
                self._recovery.reconcile(self.index, records, listing.headers, files)
            else:
                self._recovery.notes.append("index missing, from another format or from before an OS restart: rebuilt")
                self._recovery.rebuild(self.index)
        except (CorruptError, *BROKEN_INDEX) as exc:
            # a record that does not parse: the tables are garbage but the environment works;
            # liblmdb's proof that the environment itself is broken: it is moved aside first
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self._recovery.notes.append(f"index unreadable ({exc}): rebuilt")
            if isinstance(exc, BROKEN_INDEX):
                self.index.close()
                self.index = self._recovery.fresh_index()
            self._recovery.rebuild(self.index)
        self._recovery.sweep_orphans(self.index, gc_grace, files, live)
        self._catalog.load(self.index)
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
        finished = self._recovery.roll_back_pending(self.index, self.index.entries(tokens=False))
        self.refresh()
        return finished

    def sweep(self, gc_grace: float) -> int:
        """Under the lock: ``Recovery.sweep_orphans`` on the index we hold."""
        return self._recovery.sweep_orphans(self.index, gc_grace)
