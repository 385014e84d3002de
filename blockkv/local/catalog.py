"""The in-memory catalog of one store handle: every entry of its directory
and a prefix trie per namespace, so that ``find`` is a lookup that reads no
index and waits on no lock.

Following an index, it holds no entry's tokens or block names, so what an
entry costs in memory is bounded whatever its length (docs/design.md, "The
in-memory catalog"): a load reads the tokens from the index in its one read
transaction; after it, the tries read the edge labels they compare from the
entries' header files (``HeaderPages``: immutable once committed, read with
no lock, checked against a digest of the indexed tokens), and what a lookup
hands out is read from its header too. The block names stay in the index,
read in one transaction by the handle's own passes (the cap, eviction).
Built without an index (``add``: a read-only view of headers), it holds them.

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
from dataclasses import dataclass, field

import lmdb
import numpy as np

from blockkv.errors import LockTimeout
from blockkv.local.header_pages import HeaderPages, tokens_digest
from blockkv.local.index import Index
from blockkv.local.index_records import gc_paused
from blockkv.local.locks import waiting_at_most
from blockkv.local.prefix_index import PrefixIndex, TokensOf
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


class IndexedPages:
    """Where the entries of a catalog following an index are read when asked
    (``records.Paged``): their tokens from their header files (no lock), their
    block names from the index's rows (the handle's own passes, under its
    lock). A header that cannot be read now, or is not the one indexed, leaves
    the reader to the index's row if its lock is free at once, never waited for
    (``now``): a damaged header is then found, and its restore convicts it."""

    def __init__(self, headers: HeaderPages, lookup: Callable[[str], Entry | None]) -> None:
        self.headers = headers
        self.index: Index | None = None  # the one followed now
        self._lookup = lookup

    def tokens_or_none(self, entry: Entry) -> np.ndarray | None:
        tokens = self.headers.tokens(entry)
        if tokens is None:
            row = self.now(entry.id)
            tokens = row[0] if row is not None else None
        return tokens

    def holding(self, entry: Entry) -> Entry | None:
        """``entry`` holding its tokens and block names (``HeaderPages.holding``, else ``now``)."""
        held = self.headers.holding(entry)
        if held is None:
            row = self.now(entry.id)
            held = entry.holding(*row) if row is not None else None
        return held

    def now(self, entry_id: str) -> tuple[np.ndarray, tuple[str, ...]] | None:
        """The entry's row in the index, if its transaction lock is free now."""
        if self.index is None:
            return None
        try:
            with waiting_at_most(0.0):
                return self.index.rows_of([entry_id]).get(entry_id)
        except (LockTimeout, lmdb.Error):
            return None

    def tokens(self, entry_id: str) -> np.ndarray:
        entry = self._lookup(entry_id)
        tokens = self.tokens_or_none(entry) if entry is not None else None
        if tokens is None:
            raise KeyError(f"entry {entry_id}: removed, or its tokens are unreadable now")
        return tokens

    def blocks(self, entry_id: str) -> tuple[str, ...]:
        blocks = self.index.blocks_of([entry_id]).get(entry_id) if self.index is not None else None
        if blocks is None:
            raise KeyError(f"entry {entry_id} is no longer in the index")
        return blocks


@dataclass
class _Tables:
    """What the catalog holds, built whole by a load before it replaces the last."""

    entries: dict[str, Entry] = field(default_factory=dict)  # served
    kin: dict[str, Entry] = field(default_factory=dict)
    foreign: dict[str, Entry] = field(default_factory=dict)  # another identity's: never served, counted or evicted
    tries: dict[str, PrefixIndex[Entry]] = field(default_factory=dict)
    digests: dict[str, int] = field(default_factory=dict)  # of each entry's indexed tokens (HeaderPages)


class Catalog:
    def __init__(self, served: Collection[str], clock: Callable[[], float], kin: Collection[str] = (),
                 headers: HeaderPages | None = None) -> None:
        """``headers``: where the tokens are read once an index is loaded (None:
        the catalog holds its entries' tokens, for ``add``)."""
        self._served = frozenset(served)  # Identity.digest()s whose entries are served
        self._kin = frozenset(kin)  # digests whose entries are counted and evicted, not served
        self._clock = clock
        self._mutex = threading.RLock()
        self._t = _Tables()
        self._pages = IndexedPages(headers, self._any) if headers is not None else None
        self._position: tuple[bytes, int] = (b"", 0)
        self.loaded = False  # read from an index at least once

    def _any(self, entry_id: str) -> Entry | None:
        t = self._t
        return t.entries.get(entry_id) or t.kin.get(entry_id) or t.foreign.get(entry_id)

    def _label_tokens(self, entry_id: str) -> np.ndarray | None:
        """A trie label's source tokens, from the entry's header (None: gone)."""
        entry = self._t.entries.get(entry_id)
        return self._pages.tokens_or_none(entry) if entry is not None and self._pages is not None else None

    # -- following the index ------------------------------------------------------
    def load(self, index: Index) -> None:
        """Rebuild from the tables in one read transaction, the tries comparing
        the tokens as views of the map (``Index.scan_entries``): none is held
        after it. Everything is read before anything changes: a load cut short
        (a busy lock) leaves the catalog as it was."""
        if self._pages is None:
            raise ValueError("this catalog holds its entries: it is built with add, not from an index")
        with self._mutex, gc_paused():
            position = index.position()  # first: a change made while we read is replayed, not lost
            last_use = index.last_use()
            sizes = index.block_sizes()
            fresh = [_Tables()]

            def add(record: EntryRecord, tokens_of: TokensOf) -> None:
                self._add(fresh[-1], record, last_use.get(record.id, 0.0), sizes, tokens_of)

            index.scan_entries(add, begin=lambda: fresh.append(_Tables()))
            self._t = fresh[-1]
            self._pages.headers.follow(self._t.digests)
            self._pages.index = index
            self._position = position
            self.loaded = True

    def apply_changes(self, index: Index) -> None:
        """Replay what changed in the tables since we last looked (raises ``lmdb.Error``)."""
        with self._mutex:
            changes = index.changes_since(self._position) if self.loaded else None
            if changes is None or self._pages is None or self._pages.index is not index:
                self.load(index)  # never loaded, another generation of the tables, trimmed past us, other tables
                return
            position, ops = changes
            if not ops:
                return
            last: dict[str, str] = {}  # the tables hold each entry as its last change left it
            for op, entry_id in ops:
                last[entry_id] = op
            for entry_id, op in last.items():  # the removals first: a trie reads the labels of live entries
                if op == "-":
                    self.drop(entry_id)
            try:
                for entry_id, op in last.items():  # the additions in the order they were made
                    if op == "+" and self._any(entry_id) is None:
                        record = index.entry(entry_id)
                        if record is not None:
                            self._add(self._t, record, self._clock(), index.block_sizes(record.blocks), None)
            except LookupError:  # a label's headers all gone: another process removed entries since
                self.load(index)
                return
            self._position = position

    def add(self, record: EntryRecord, last_use: float, sizes: Mapping[str, int]) -> None:
        """Add one entry no index holds (a read-only view of the headers, local/read_only.py): held, not paged."""
        with self._mutex:
            if self._pages is not None:
                raise ValueError("this catalog follows an index: its entries come from there")
            self._add(self._t, record, last_use, sizes, None)

    def _add(self, t: _Tables, record: EntryRecord, last_use: float, sizes: Mapping[str, int],
             tokens_of: TokensOf | None) -> None:
        """Add to ``t``; ``record``'s tokens need only last the call (``tokens_of``:
        where the trie reads labels meanwhile; None: its own reader)."""
        nbytes = record.header_bytes + sum(sizes.get(n, 0) for n in record.blocks)
        entry = Entry.of(record, nbytes, last_use, self._pages)
        if self._pages is not None:
            t.digests[entry.id] = tokens_digest(record.tokens)
        if record.owner not in self._served:
            (t.kin if record.owner in self._kin else t.foreign)[entry.id] = entry
            return
        t.entries[entry.id] = entry
        trie = t.tries.get(entry.ns)
        if trie is None:  # not setdefault: that would build a throwaway trie per entry
            trie = t.tries[entry.ns] = PrefixIndex(self._label_tokens if self._pages is not None else None)
        trie.add(entry, record.tokens, tokens_of)

    def drop(self, entry_id: str) -> None:
        """Forget an entry removed from the tables (needs none of its tokens: they may be gone)."""
        with self._mutex:
            t = self._t
            t.foreign.pop(entry_id, None)
            t.kin.pop(entry_id, None)
            t.digests.pop(entry_id, None)
            entry = t.entries.pop(entry_id, None)
            if entry is not None:
                t.tries[entry.ns].remove(entry_id)
            if self._pages is not None:
                self._pages.headers.forget(entry_id)

    # -- lookups --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._t.entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._t.entries

    def get(self, entry_id: str) -> Entry | None:
        return self._t.entries.get(entry_id)

    def entries(self, ns: str | None = None) -> list[Entry]:
        """The served entries, or (``ns`` given) one namespace's (paged: for the handle's own use)."""
        with self._mutex:
            return [e for e in self._t.entries.values() if ns is None or e.ns == ns]

    def every_identity(self) -> list[Entry]:
        """Served, kin and foreign entries: every entry the directory's files hold."""
        with self._mutex:
            return [*self._t.entries.values(), *self._t.kin.values(), *self._t.foreign.values()]

    def ours(self) -> list[Entry]:
        """Served and kin entries: what the cap counts and eviction may remove."""
        with self._mutex:
            return [*self._t.entries.values(), *self._t.kin.values()]

    def foreign(self) -> list[Entry]:
        """Other identities' entries: never served, counted or evicted."""
        with self._mutex:
            return list(self._t.foreign.values())

    def unserved(self) -> list[Entry]:
        """Kin and foreign entries: indexed here, never served by this handle."""
        with self._mutex:
            return [*self._t.kin.values(), *self._t.foreign.values()]

    def with_blocks(self, entries: Iterable[Entry]) -> list[Entry]:
        """``entries`` holding their block names, read from the index in one
        transaction, not one each: for a pass over many entries' blocks."""
        entries = list(entries)
        if self._pages is None or self._pages.index is None:
            return entries
        blocks = self._pages.index.blocks_of(e.id for e in entries)
        return [e.holding(e._tokens, blocks.get(e.id, ())) for e in entries]

    def detached(self, entries: Iterable[Entry]) -> list[Entry]:
        """Copies of ``entries`` that hold their tokens and block names, read in
        one transaction of the index (at most ``REFRESH_WAIT`` for its lock
        unless the handle holds it; busy: from their headers): what a caller is
        handed, readable after the entry is removed or the handle closed. One no
        longer in the index, or whose header is gone, stays paged."""
        entries = list(entries)
        if self._pages is None or self._pages.index is None:
            return entries
        try:
            rows = self._pages.index.rows_of(e.id for e in entries)
        except LockTimeout:
            return [self.from_header(e) for e in entries]
        return [e.holding(*rows[e.id]) if e.id in rows else e for e in entries]

    def from_header(self, entry: Entry) -> Entry:
        """A copy of ``entry`` holding its tokens and block names, read from its
        header (no lock: what ``find`` hands out; ``IndexedPages.holding``). If
        neither its header nor the index can say now, ``entry`` as it is
        (paged): its restore then finds out what is wrong, as without paging."""
        held = self._pages.holding(entry) if self._pages is not None else None
        return held if held is not None else entry

    def footprint(self, index: Index) -> int:
        """The bytes the handle's cap counts: its own identity's entries, of
        either mode (``footprint``). With no other identity in the directory
        that is every referenced byte, which the index keeps as one number."""
        if not self._t.foreign:
            return index.total_bytes()
        return footprint(self.with_blocks(self.ours()), index.block_sizes())

    def eviction_plan(self, last_use: Mapping[str, float], block_sizes: Mapping[str, int], total: int,
                      target: int) -> list[Entry]:
        """``lru_plan`` over the handle's own identity's entries, of either mode, by ``last_use``."""
        plan = lru_plan(self.with_blocks(self.ours()), last_use, block_sizes, total, target)
        return [self._any(e.id) or e for e in plan]

    def in_namespace(self, ns: str) -> list[Entry]:
        """One namespace's entries, in its trie's order."""
        with self._mutex:
            return list(self._t.tries.get(ns, ()))

    def prefixes_of(self, ns: str, tokens: np.ndarray) -> list[Entry]:
        """The namespace's entries whose tokens are a prefix of ``tokens`` (them included)."""
        with self._mutex:
            trie = self._t.tries.get(ns)
            return trie.prefixes_of(tokens) if trie is not None else []

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        with self._mutex:
            trie = self._t.tries.get(ns)
            return trie is not None and trie.has_durable_prefix(tokens)

    def find(self, tokens: np.ndarray, ns: str) -> Match | None:
        with self._mutex:
            trie = self._t.tries.get(ns)
            found = trie.find(tokens) if trie is not None else None
        return Match(*found) if found else None

    def find_exact(self, tokens: np.ndarray, ns: str) -> Match | None:
        with self._mutex:
            trie = self._t.tries.get(ns)
            entry = trie.exact(tokens) if trie is not None else None
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
            try:
                tokens = entry.token_array
            except KeyError:  # removed since we looked, or its header is not the one indexed
                continue
            if not np.array_equal(tokens[: len(prompt)], prompt):
                continue
            if best is None or entry.length > best.length:
                best = entry
        return best
