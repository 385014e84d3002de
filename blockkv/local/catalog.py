"""The in-memory catalog of one store handle: every entry of its directory,
a prefix trie per namespace and an exact map, so that ``find`` is a pure
lookup that reads no file.

It mirrors the index's ``entries`` table and follows it through the change
log (``apply_changes``); it is never the truth and never writes. Another
identity's entries are kept apart: never served, never counted toward the
handle's cap nor evicted by it (the seed's rule: never ours to delete or
serve). The handle's identity in its other mode (entries stored with or
without ``isolate_namespaces``: ``blocks.modes``) is kin: the same model's
entries, counted toward the cap and evicted in LRU order with the served
ones, never served by a handle that names blocks the other way.
Thread-safe: one mutex guards every structure.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

import numpy as np

from blockkv.local.index import Index
from blockkv.local.index_records import gc_paused
from blockkv.local.prefix_index import PrefixIndex
from blockkv.records import CHECKPOINT_NS, Entry, EntryRecord, Match


def footprint(entries: Iterable[Entry], sizes: Mapping[str, int]) -> int:
    """Headers plus every block ``entries`` reference, each counted once
    (``sizes``: each block's stored bytes)."""
    entries = list(entries)
    return sum(e.header_bytes for e in entries) + sum(sizes.get(n, 0) for n in {n for e in entries for n in e.blocks})


def lru_plan(entries: Iterable[Entry], last_use: Mapping[str, float], sizes: Mapping[str, int],
             total: int, target: int) -> list[Entry]:
    """The entries whose removal brings ``total`` bytes (their ``footprint``)
    down to ``target``, least recently used first (ties in the given order):
    an entry frees its header and the blocks no other of ``entries`` still
    references."""
    entries = list(entries)
    refs = Counter(n for e in entries for n in dict.fromkeys(e.blocks))
    plan = []
    for entry in sorted(entries, key=lambda e: last_use.get(e.id, 0.0)):
        if total <= target:
            break
        plan.append(entry)
        total -= entry.header_bytes
        for name in dict.fromkeys(entry.blocks):
            refs[name] -= 1
            if refs[name] == 0:
                total -= sizes.get(name, 0)
    return plan


class Catalog:
    def __init__(self, served: Collection[str], clock: Callable[[], float], kin: Collection[str] = ()) -> None:
        self._served = frozenset(served)  # Identity.digest()s whose entries are served
        self._kin = frozenset(kin)  # digests whose entries are counted and evicted, not served
        self._clock = clock
        self._mutex = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._kin_entries: dict[str, Entry] = {}
        self._foreign: dict[str, Entry] = {}  # another identity's entries: never served, counted or evicted
        self._tries: dict[str, PrefixIndex[Entry]] = {}
        self._exact: dict[tuple[str, bytes], str] = {}
        self._position: tuple[bytes, int] = (b"", 0)
        self.loaded = False  # read from an index at least once

    # -- following the index ------------------------------------------------------
    def load(self, index: Index, records: list[EntryRecord] | None = None) -> None:
        """Rebuild from the tables (``records``: already read). Everything is
        read before anything changes: a load cut short (a busy lock) leaves
        the catalog as it was."""
        with self._mutex, gc_paused():
            position = index.position()  # first: a change made while we read is replayed, not lost
            last_use = index.last_use()
            sizes = index.block_sizes()
            if records is None:
                records = index.entries()
            self._entries, self._kin_entries, self._foreign, self._tries, self._exact = {}, {}, {}, {}, {}
            for record in records:
                self._add(record, last_use.get(record.id, 0.0), sizes)
            self._position = position
            self.loaded = True

    def apply_changes(self, index: Index) -> None:
        """Replay what changed in the tables since we last looked (raises ``lmdb.Error``)."""
        with self._mutex:
            changes = index.changes_since(self._position) if self.loaded else None
            if changes is None:  # never loaded, another generation of the tables, or trimmed past us
                self.load(index)
                return
            position, ops = changes
            if not ops:
                return
            for op, entry_id in ops:
                if op == "-":
                    self.drop(entry_id)
                elif not any(entry_id in d for d in (self._entries, self._kin_entries, self._foreign)):
                    record = index.entry(entry_id)
                    if record is not None:
                        self._add(record, self._clock(), index.block_sizes(record.blocks))
            self._position = position

    def add(self, record: EntryRecord, last_use: float, sizes: Mapping[str, int]) -> None:
        """Add one entry no index holds (a remote tier's catalog of bucket headers, remote/remote_catalog.py)."""
        with self._mutex:
            self._add(record, last_use, sizes)

    def _add(self, record: EntryRecord, last_use: float, sizes: Mapping[str, int]) -> None:
        entry = Entry.of(record, record.header_bytes + sum(sizes.get(n, 0) for n in record.blocks), last_use)
        if record.owner not in self._served:
            (self._kin_entries if record.owner in self._kin else self._foreign)[entry.id] = entry
            return
        self._entries[entry.id] = entry
        trie = self._tries.get(entry.ns)
        if trie is None:  # not setdefault: that would build a throwaway trie per entry
            trie = self._tries[entry.ns] = PrefixIndex()
        trie.add(entry, entry.token_array)
        self._exact[(entry.ns, entry.token_array.tobytes())] = entry.id

    def drop(self, entry_id: str) -> None:
        """Forget an entry removed from the tables by this handle."""
        with self._mutex:
            self._foreign.pop(entry_id, None)
            self._kin_entries.pop(entry_id, None)
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                return
            self._tries[entry.ns].remove(entry_id)
            key = (entry.ns, entry.token_array.tobytes())
            if self._exact.get(key) == entry_id:
                del self._exact[key]

    # -- lookups --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._entries

    def get(self, entry_id: str) -> Entry | None:
        return self._entries.get(entry_id)

    def entries(self, ns: str | None = None) -> list[Entry]:
        """The served entries, or (``ns`` given) one namespace's."""
        with self._mutex:
            return [e for e in self._entries.values() if ns is None or e.ns == ns]

    def every_identity(self) -> list[Entry]:
        """Served, kin and foreign entries: every entry the directory's files hold."""
        with self._mutex:
            return [*self._entries.values(), *self._kin_entries.values(), *self._foreign.values()]

    def ours(self) -> list[Entry]:
        """Served and kin entries: what the cap counts and eviction may remove."""
        with self._mutex:
            return [*self._entries.values(), *self._kin_entries.values()]

    def foreign(self) -> list[Entry]:
        """Other identities' entries: never served, counted or evicted."""
        with self._mutex:
            return list(self._foreign.values())

    def unserved(self) -> list[Entry]:
        """Kin and foreign entries: indexed here, never served by this handle."""
        with self._mutex:
            return [*self._kin_entries.values(), *self._foreign.values()]

    def footprint(self, index: Index) -> int:
        """The bytes the handle's cap counts: its own identity's entries, of
        either mode (``footprint``). With no other identity in the directory
        that is every referenced byte, which the index keeps as one number."""
        if not self._foreign:
            return index.total_bytes()
        return footprint(self.ours(), index.block_sizes())

    def eviction_plan(self, last_use: Mapping[str, float], block_sizes: Mapping[str, int], total: int,
                      target: int) -> list[Entry]:
        """``lru_plan`` over the handle's own identity's entries, of either mode, by ``last_use``."""
        return lru_plan(self.ours(), last_use, block_sizes, total, target)

    def in_namespace(self, ns: str) -> list[Entry]:
        """One namespace's entries, in its trie's order."""
        with self._mutex:
            return list(self._tries.get(ns, ()))

    def prefixes_of(self, ns: str, tokens: np.ndarray) -> list[Entry]:
        """The namespace's entries whose tokens are a prefix of ``tokens`` (them included)."""
        with self._mutex:
            trie = self._tries.get(ns)
            return list(trie.prefixes_of(tokens)) if trie is not None else []

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        with self._mutex:
            trie = self._tries.get(ns)
            return trie is not None and trie.has_durable_prefix(tokens)

    def find(self, tokens: np.ndarray, ns: str) -> Match | None:
        with self._mutex:
            trie = self._tries.get(ns)
            found = trie.find(tokens) if trie is not None else None
        return Match(*found) if found else None

    def find_exact(self, tokens: np.ndarray, ns: str) -> Match | None:
        with self._mutex:
            entry_id = self._exact.get((ns, tokens.tobytes()))
            entry = self._entries.get(entry_id) if entry_id else None
        return Match(entry, len(tokens)) if entry is not None else None

    def generation_checkpoint(self, prompt: np.ndarray, key: str, cache_ns: str) -> Entry | None:
        """The longest checkpoint of ``key`` that continues exactly ``prompt``."""
        best: Entry | None = None
        for entry in self.entries():
            cp = entry.checkpoint
            if cp is None or cp.key != key or cp.cache_ns != cache_ns or entry.ns != CHECKPOINT_NS + key:
                continue
            if cp.original_prompt_tokens != len(prompt) or entry.length <= len(prompt):
                continue
            if not np.array_equal(entry.token_array[: len(prompt)], prompt):
                continue
            if best is None or entry.length > best.length:
                best = entry
        return best
