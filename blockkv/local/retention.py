"""What stays and what goes: every decision of a store handle to delete,
each taken under the directory lock.

``Retention`` applies the seed's rules once an entry is visible (an
identical entry replaced, trimmable prefixes superseded, older checkpoints
of a key dropped once the new one is durable), the byte cap (LRU eviction
over the handle's own identity's entries, of either mode: another identity's
are never ours to delete) and each namespace's share of it (``namespace_share``: LRU
eviction within the namespace that outgrew it, so one tenant's stores evict
that tenant's entries, not everyone's), gc, check/repair, and what a failed restore proves (only fresh
proof of corruption drops an entry, ``verdicts.py``). It also holds the lock
discipline: the lock is taken with the index checked current
(``IndexKeeper.locked``), and the stores a recovery found dead after their
header landed get the rules and cap their store would have applied. The
deleting itself is ``Commits.remove``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import lmdb

from blockkv.arguments import check_size
from blockkv.errors import BlockKVError, BlockMissingError, CorruptBlockError, CorruptError, LockTimeout
from blockkv.format.blocks import block_naming_key
from blockkv.local.catalog import Catalog, footprint, lru_plan
from blockkv.local.commit import remove_entry
from blockkv.local.directory import Directory
from blockkv.local.directory_check import inspect_directory, verify_blocks
from blockkv.local.directory_check import repair as repair_directory
from blockkv.local.index_keeper import REFRESH_WAIT, IndexKeeper
from blockkv.local.locks import each_wait_at_most, waiting_at_most
from blockkv.local.verdicts import Finding, judge_now, keys_naming
from blockkv.records import CheckReport, Entry

_SERVING_WAIT = 0.2  # the longest a restore waits for either lock (to drop a failed entry)


class Settings(Protocol):
    """The handle's options as they are now: the cap may follow a caller's
    ``limit``, and a tool may set ``gc_grace`` on an open handle."""

    gc_grace: float
    tmp_grace: float
    lock_timeout: float
    namespace_share: float | None  # the most of max_bytes one namespace but the default holds

    @property
    def max_bytes(self) -> int: ...


class Retention:
    evicted = 0  # entries removed by eviction (the cap or evict_to) since the handle opened

    def __init__(self, directory: Directory, keeper: IndexKeeper, catalog: Catalog,
                 settings: Settings, clock: Callable[[], float], warn: Callable[..., None]) -> None:
        self._dir = directory
        self._keeper = keeper
        self._catalog = catalog
        self._settings = settings
        self._clock = clock
        self._warn = warn

    # -- the lock, and the index current under it --------------------------------------
    @contextmanager
    def locked(self, timeout: float | None = None, *, recover: bool = False) -> Iterator[None]:
        """The directory lock for a mutation (``LockTimeout`` after ``timeout``,
        default ``lock_timeout``), with the index checked current first and
        recovered if it was replaced (``IndexKeeper.locked``). Each of its
        transactions waits ``lock_timeout`` at most for its turn: a stopped
        reader costs a store that long, then it is "not stored"."""
        settings = self._settings
        wait = settings.lock_timeout if timeout is None else timeout
        with each_wait_at_most(max(wait, settings.lock_timeout)):
            with self._keeper.locked(wait, settings.gc_grace, recover=recover) as finished:
                self._finish_dead_stores(finished)
                yield

    def _finish_dead_stores(self, finished: list[str]) -> None:
        """Stores that died after their header landed, indexed now by the
        roll-back of their pending references: apply the rules and the cap
        their store would have applied."""
        for entry_id in finished:
            entry = self._catalog.get(entry_id)
            if entry is not None:
                self._apply_store_rules(entry)
        if finished:
            self._evict_to_cap()

    def refresh(self) -> None:
        """Bring the catalog up to what other handles changed. An index replaced
        under us is reopened and recovered now if the lock is free (a query
        never waits for it, nor more than ``REFRESH_WAIT`` for a transaction);
        if not, serve the last known state and retry next call."""
        if self._keeper.refresh():
            return
        try:
            with waiting_at_most(REFRESH_WAIT), self.locked(timeout=0):
                pass
        except (lmdb.Error, OSError, CorruptError) as exc:
            self._warn("index-reopen", f"could not reopen the LMDB index ({exc}); serving the last known state")

    def every_entry(self) -> list[Entry]:
        """Every identity's entries, brought current: what the remote tier takes as local."""
        self.refresh()
        return self._catalog.every_identity()

    # -- the seed's rules -----------------------------------------------------------------
    def landed(self, entry_id: str) -> list[Entry]:
        """Under the lock, an entry just made visible: the seed's rules, then the
        cap. Returns the entries the rules removed."""
        self.refresh()
        new = self._catalog.get(entry_id)
        replaced = self._apply_store_rules(new)
        share = self._settings.namespace_share
        if share is not None and new.ns:
            self.evict_to(int(self._settings.max_bytes * share), ns=new.ns)
        self._evict_to_cap()
        return replaced

    def _apply_store_rules(self, new: Entry) -> list[Entry]:
        """Replace an identical entry; let a trimmable entry supersede its prefixes;
        a checkpoint supersedes older checkpoints of its key (all after it is durable).
        Returns the entries removed."""
        doomed = [e for e in self._catalog.prefixes_of(new.ns, new.token_array)  # same ns, tokens a prefix of the new ones
                  if e is not new and (e.length == new.length  # identical: replaced
                                       or (new.trimmable and e.length >= new.minimum_reusable_offset))]
        if new.checkpoint is not None:  # its namespace holds only this key's checkpoints
            doomed += [e for e in self._catalog.in_namespace(new.ns) if e is not new and e.checkpoint is not None
                       and e.checkpoint.key == new.checkpoint.key]
        for entry in dict.fromkeys(doomed):
            self._remove_quietly(entry.id)
        return list(dict.fromkeys(doomed))

    # -- remove ---------------------------------------------------------------------------
    def remove(self, entry_id: str) -> None:
        self._remove_current(lambda: [entry_id], f"entry {entry_id}")

    def remove_checkpoints(self, key: str) -> None:
        """Every generation checkpoint of ``key``."""
        self._remove_current(lambda: [e.id for e in self._catalog.entries()
                                      if e.checkpoint is not None and e.checkpoint.key == key],
                             f"checkpoints of {key!r}")

    def _remove_current(self, entry_ids: Callable[[], list[str]], what: str) -> None:
        """Remove the entries ``entry_ids()`` names once the catalog is current;
        a busy lock is a warning (``what`` not removed)."""
        try:
            with self.locked():
                self.refresh()
                for entry_id in entry_ids():
                    self._remove_quietly(entry_id)
        except LockTimeout as exc:
            self._warn("lock", f"{what} not removed: {exc}")

    def _remove_quietly(self, entry_id: str) -> None:
        try:
            self._remove_locked(entry_id)
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("remove", f"could not remove entry {entry_id}: {exc}")

    def _remove_locked(self, entry_id: str) -> None:
        """Remove an entry from the files and the index (``commit.remove_entry``), then from the catalog."""
        remove_entry(self._dir, self._dir.fs, self._clock, self._warn, self._keeper.index, entry_id)
        self.refresh()
        self._catalog.drop(entry_id)

    def restore_failed(self, entry: Entry, exc: BaseException, reading: str) -> None:
        """Only proof of corruption deletes: a corrupt header or block, or the
        entry's own header or block file gone (``reading``: what was being read,
        ``EntryRead.culprit``). Anything else (EMFILE, EIO, MemoryError, an
        exception from mlx or mlx-lm) is a miss that keeps the entry, its
        header and its index row as they were."""
        proof = (isinstance(exc, (CorruptError, BlockMissingError))
                 or (reading == "header" and isinstance(exc, FileNotFoundError)))
        if not proof:
            self._warn("restore-miss", f"restore of entry {entry.id} failed ({exc!r}); kept, served as a miss")
            return
        block = reading if isinstance(exc, (CorruptBlockError, BlockMissingError)) and reading != "header" else ""
        try:
            with waiting_at_most(_SERVING_WAIT), self.locked(timeout=_SERVING_WAIT):
                self.refresh()
                for entry_id in self._convicted(entry, exc, block):
                    self._remove_locked(entry_id)
        except (OSError, lmdb.Error, BlockKVError) as exc2:  # LockTimeout included: the next restore retries
            self._warn("remove", f"could not drop entry {entry.id}: {exc2}")

    # -- last use -----------------------------------------------------------------------
    def used(self, entry_id: str, when: float) -> None:
        """A restore's use of ``entry_id`` (its header's mtime says it already):
        into the index now if the lock is free and the index is being written
        anyway, else with this handle's next locked section
        (``IndexKeeper.used``: the index is written under the lock only, and
        the first write into a settled index costs a directory fsync that a
        restore should not wait for)."""
        self._keeper.used(entry_id, when)
        if not self._keeper.index.dirty():
            return
        try:
            with waiting_at_most(0.0), self.locked(timeout=0):
                pass
        except (LockTimeout, OSError, lmdb.Error, CorruptError):
            pass  # kept with the handle; eviction reads the header's mtime meanwhile

    def _convicted(self, entry: Entry, exc: BaseException, block: str) -> set[str]:
        """Under the lock: the entries a failed restore of ``entry`` proves
        damaged. A failure of ``block`` is decided again first, on the copy
        there now and under every key that names it (``verdicts.judge_now``):
        a corrupt block is quarantined with every entry that needs it (the
        next store of it writes a good copy); a block good under another
        entry's key convicts only this entry's header; a block that verifies
        or cannot be read now proves nothing."""
        own, finding = self._catalog.with_blocks(self._catalog.entries()), None
        if block:
            others = keys_naming(block, self._dir.identity, [e for e in own if e.id != entry.id],
                                 self._catalog.with_blocks(self._catalog.unserved()))
            finding = judge_now(self._dir.pool, block, block_naming_key(self._dir.identity, entry.ns), others)
        if finding in (Finding.GOOD, Finding.UNREADABLE):
            self._warn("restore-miss", f"restore of entry {entry.id} failed ({exc}), but block {block} "
                       f"{finding.value}: kept, served as a miss")
            return set()
        self._warn("restore", f"restore failed, dropping entry {entry.id}: {exc}"
                   + (f"; the block {finding.value}" if finding is not None else ""))
        doomed = {entry.id} if entry.id in self._catalog else set()
        if finding is Finding.CORRUPT:
            self._dir.pool.delete(block)
            doomed |= {e.id for e in own if block in e.blocks}
        return doomed

    # -- the cap ----------------------------------------------------------------------------
    def plan(self, target_bytes: int) -> list[Entry]:
        """The entries eviction down to ``target_bytes`` would remove, LRU first."""
        return self._catalog.detached(self._plan(target_bytes)[0])

    def _plan(self, target_bytes: int, ns: str | None = None) -> tuple[list[Entry], dict[str, float]]:
        """``plan`` (of namespace ``ns``'s entries only, against their own
        footprint, if given), and the last uses its candidates' headers showed
        later than the index records (another handle's restore not yet in the
        index): an entry is never evicted on a last use its header contradicts."""
        index = self._keeper.index
        candidates = self._catalog.with_blocks(self._catalog.in_namespace(ns)) if ns is not None else None
        total = self.footprint() if candidates is None else footprint(candidates, index.block_sizes())
        if total <= target_bytes:  # the common case: every store checks the cap
            return [], {}
        last_use, block_sizes = index.last_use(), index.block_sizes()  # read once: the loop only revises last uses
        later: dict[str, float] = {}
        checked: set[str] = set()
        while True:
            plan = (self._catalog.eviction_plan(last_use, block_sizes, total, target_bytes) if candidates is None
                    else lru_plan(candidates, last_use, block_sizes, total, target_bytes))
            found = self._dir.used_later([(e.ns, e.id) for e in plan if e.id not in checked], last_use)
            checked.update(e.id for e in plan)
            if not found:
                return plan, later
            last_use.update(found)
            later.update(found)

    def footprint(self) -> int:
        """What the cap counts: the handle's own identity's headers and blocks,
        of either mode (``Catalog.footprint``). Another identity in the directory is a
        configuration mistake, warned about once; its entries are its own.
        The catalog is brought current first: which entries are ours decides
        what the total is."""
        self.refresh()
        if self._catalog.foreign():
            self._warn("identities", "entries of another identity (another tokenizer or chat template) share "
                       f"the fingerprint directory {self._dir.path.name}: give each its own config_fingerprint; "
                       "each handle's cap counts and evicts only its own identity's entries")
        return self._catalog.footprint(self._keeper.index)

    def evict_to(self, target_bytes: int, ns: str | None = None) -> list[Entry]:
        """Remove least recently used entries (of namespace ``ns`` only, if
        given) until their total is at most ``target_bytes``."""
        try:
            with self.locked():
                plan, later = self._plan(target_bytes, ns)
                plan = self._catalog.detached(plan)  # handed out: readable once removed
                if later:
                    self._keeper.index.touch(later)
                for entry in plan:
                    self._remove_quietly(entry.id)
                self.evicted += len(plan)
                if plan:
                    self._sweep_quietly()
        except LockTimeout as exc:
            self._warn("lock", f"eviction skipped: {exc}")
            return []
        return plan

    def _evict_to_cap(self) -> None:
        """The cap bounds what the handle's identity holds in the directory
        (``footprint``), blocks waiting out their grace included: past it the
        grace (policy, not safety) yields and they go at once, then least
        recently used entries of ours. Blocks past their grace
        go with the next store, without anyone running ``gc``."""
        cap = self._settings.max_bytes
        check_size("target_bytes", cap)  # a caller's ``limit`` may return anything
        waiting, expired = self._keeper.index.unreferenced(self._clock(), self._settings.gc_grace)
        if self.footprint() + waiting <= cap:
            if expired:
                self._sweep_quietly()
            return
        if waiting:
            self._sweep_quietly(grace=0.0)
        if self.evict_to(cap):
            self._sweep_quietly(grace=0.0)

    # -- gc, check, rebuild ------------------------------------------------------------------
    def gc(self) -> int:
        """Give back the references of stores whose writer died
        (``IndexKeeper.roll_back_pending``), then delete blocks nothing
        references and no live writer may (``Recovery.sweep_orphans``) and dead
        writers' temp files; returns how many blocks."""
        try:
            with self.locked():
                self._finish_dead_stores(self._keeper.roll_back_pending())
                n = self._keeper.sweep(self._settings.gc_grace)
                self._keeper.index.trim_log()
        except LockTimeout as exc:
            self._warn("lock", f"gc skipped: {exc}")
            return 0
        return n

    def _sweep_quietly(self, grace: float | None = None) -> None:
        try:
            self._keeper.sweep(self._settings.gc_grace if grace is None else grace)
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("gc", f"gc failed: {exc}")

    def check(self, repair: bool, progress: Callable[[int, int], None] | None) -> CheckReport:
        """``BlockStore.check``: block hashes verified without the lock, the
        comparison of files and index (and any repair) under it."""
        verified = verify_blocks(self._dir, progress)
        with self.locked():
            report = inspect_directory(self._dir, self._keeper.index.blocks(), verified=verified,
                                       tmp_cutoff=self._clock() - self._settings.tmp_grace)
            if repair and not report.clean:
                repair_directory(self._dir, report)
                self._keeper.rebuild()
                report.actions.append("rebuilt the index from the headers")
        return report

    def rebuild(self) -> None:
        """Throw the LMDB tables away and rebuild them from the header files."""
        with self.locked():
            self._keeper.rebuild()
