"""What a node keeps in memory of the entries only the bucket holds: a row of
numpy columns each, and a digest per block (issue #23), never their tokens
and no Python object per entry.

Each entry's token prefixes are digested at every multiple of ``block_tokens``
(chained keyed blake3 rooted in its namespace: ``prefix_digests.py``), and the
digests of every entry live in one sorted array (8 bytes and a 4-byte slot per
block), beside the first 8 bytes of each block's name (for the uploader's
"is this block likely in the bucket already") and one digest of the whole
token sequence (for ``find_exact``). A lookup digests the prompt the same way
and finds, deepest first, the levels at which entries share its whole
blocks: those are the candidates. The exact common prefix, the partial last
block and every rule that needs tokens are settled from each candidate's
header, which the tier reads from its cache on disk (tier.py). Nothing here
reads a file or the network.

The key is this process's own: digests are never published, and a bucket
writer cannot aim a collision at them (one would only cost a header read).
Thread-safe: one lock guards every structure; new entries are merged into the
sorted arrays in batches (``flush``, or the next lookup).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

from blockkv.prefix_digests import DIGEST_BYTES, chain_digests

_COMPACT_FRACTION = 4  # compact the arrays once rows of forgotten entries exceed 1/4 of them


@dataclass(slots=True, eq=False)
class RemoteEntry:
    """An entry only the bucket holds, as the catalog hands it out (made from its
    row when asked for): no tokens, no block names."""

    id: str
    ns: str
    length: int  # tokens
    trimmable: bool
    minimum_reusable_offset: int
    header_bytes: int
    nbytes: int  # header + every block's payload, as the header declares them
    last_modified: float  # its header's, in the bucket


class _Rows:
    """u64 key -> slots, as two parallel arrays sorted by key (slots in
    insertion order among equal keys). Rows are added in batches."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.uint64)
        self.slots = np.empty(0, np.uint32)
        self._pending: list[tuple[np.ndarray, int]] = []

    def __len__(self) -> int:
        return len(self.keys) + sum(len(k) for k, _ in self._pending)

    def add(self, keys: np.ndarray, slot: int) -> None:
        self._pending.append((keys, slot))

    def flush(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([k for k, _ in self._pending])
        slots = np.concatenate([np.full(len(k), s, np.uint32) for k, s in self._pending])
        self._pending = []
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        at = np.searchsorted(self.keys, keys, side="right")
        self.keys = np.insert(self.keys, at, keys)
        self.slots = np.insert(self.slots, at, slots)

    def present(self, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` have a row (of any slot, forgotten or not)."""
        at = np.searchsorted(self.keys, keys)
        inside = at < len(self.keys)
        found = np.zeros(len(keys), bool)
        found[inside] = self.keys[at[inside]] == keys[inside]
        return found

    def slots_of(self, key: np.uint64) -> np.ndarray:
        lo, hi = np.searchsorted(self.keys, key, side="left"), np.searchsorted(self.keys, key, side="right")
        return self.slots[lo:hi]

    def drop(self, dead: np.ndarray) -> None:
        """Remove the rows of the slots ``dead`` names."""
        keep = ~np.isin(self.slots, dead)
        self.keys, self.slots = self.keys[keep], self.slots[keep]


def _u64(digests: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(digests), "<u8").astype(np.uint64) if digests else np.empty(0, np.uint64)


def name_hint(name: str) -> int:
    """A block name's first 8 bytes: enough to tell the bucket's blocks apart as a hint."""
    return int(name[:16], 16)


_RECORD = np.dtype([("id_hi", "<u8"), ("id_lo", "<u8"), ("ns", "<u4"), ("length", "<u4"),
                    ("minimum_reusable_offset", "<u4"), ("header_bytes", "<u4"), ("nbytes", "<u8"),
                    ("last_modified", "<f8"), ("trimmable", "?"), ("live", "?")])


class _Records:
    """Each entry's record as one row of a numpy structured array (50 bytes), so
    a catalog of the fleet is a few arrays, not a Python object per entry."""

    def __init__(self) -> None:
        self.count = 0
        self.rows = np.zeros(16, _RECORD)

    def append(self, row: tuple) -> int:
        if self.count == len(self.rows):
            self.rows = np.concatenate([self.rows, np.zeros(len(self.rows) // 2 + 16, _RECORD)])
        self.rows[self.count] = row
        self.count += 1
        return self.count - 1

    @property
    def live(self) -> np.ndarray:
        return self.rows["live"][: self.count]


def _id_parts(entry_id: str) -> tuple[int, int]:
    return int(entry_id[:16], 16), int(entry_id[16:32], 16)


class RemoteCatalog:
    """The bucket-only entries of one store handle, keyed by entry id (32 hex
    digits, as every header name has); lookups by the digests of a prompt's
    block-aligned prefixes."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._key = os.urandom(32)
        self._lock = threading.Lock()
        self._records = _Records()
        self._live = 0
        self._ids = _Rows()  # an id's first 8 bytes -> its slots (the rest is checked in the records)
        self._chain = _Rows()  # digest of each whole-block prefix -> the entries that have it
        self._exact = _Rows()  # digest of (namespace, every token) -> the entries that are it
        self._blocks = _Rows()  # block name's first 8 bytes -> the entries that reference it
        self._ns_names: list[str] = []
        self._ns_index: dict[str, int] = {}
        self._dead: list[int] = []  # slots forgotten whose rows are still in the arrays
        self._roots: dict[str, bytes] = {}

    # -- digests --------------------------------------------------------------
    def _root(self, ns: str) -> bytes:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = blake3(b"ns\x00" + ns.encode(), key=self._key).digest(DIGEST_BYTES)
        return root

    def prompt_digests(self, tokens: np.ndarray, ns: str) -> np.ndarray:
        """The digest of each whole block-aligned prefix of ``tokens`` in ``ns``."""
        return _u64(chain_digests(tokens, self._key, self.block_tokens, self._root(ns)))

    def _whole(self, tokens: np.ndarray, ns: str) -> np.uint64:
        digest = blake3(self._root(ns) + np.asarray(tokens, "<u4").tobytes(), key=self._key).digest(DIGEST_BYTES)
        return np.frombuffer(digest, "<u8")[0]

    # -- contents --------------------------------------------------------------
    def __len__(self) -> int:
        return self._live

    def __contains__(self, entry_id: str) -> bool:
        return self._slot(entry_id) is not None

    @property
    def rows(self) -> int:
        """Rows of the digest arrays (12 bytes each): per entry, one per whole
        block of its tokens, one for all of them, one per distinct block it
        names, and one for its id."""
        with self._lock:
            self._flush()
            return sum(len(r) for r in (self._ids, self._chain, self._exact, self._blocks))

    def _slots(self, entry_id: str) -> list[int]:
        """The live slots of ``entry_id`` (one, unless it was added twice)."""
        if len(entry_id) != 32:
            return []
        try:
            hi, lo = _id_parts(entry_id)
        except ValueError:
            return []
        with self._lock:
            self._flush()
            rows = self._records.rows
            return [int(s) for s in self._ids.slots_of(np.uint64(hi)) if rows["live"][s] and rows["id_lo"][s] == lo]

    def _slot(self, entry_id: str) -> int | None:
        slots = self._slots(entry_id)
        return slots[-1] if slots else None

    def _entry(self, slot: int) -> RemoteEntry:
        hi, lo, ns, length, offset, header_bytes, nbytes, last_modified, trimmable, _ = self._records.rows[slot].item()
        return RemoteEntry(f"{hi:016x}{lo:016x}", self._ns_names[ns], length, trimmable, offset, header_bytes,
                           nbytes, last_modified)

    def get(self, entry_id: str) -> RemoteEntry | None:
        slot = self._slot(entry_id)
        if slot is None:
            return None
        with self._lock:
            return self._entry(slot)

    def entries(self) -> list[RemoteEntry]:
        with self._lock:
            return [self._entry(int(s)) for s in np.flatnonzero(self._records.live)]

    def namespaces(self) -> list[str]:
        with self._lock:
            used = self._records.rows["ns"][: self._records.count][self._records.live]
            return sorted(self._ns_names[i] for i in np.unique(used))

    def add(self, entry_id: str, ns: str, tokens: np.ndarray, blocks: Sequence[str], *,
            trimmable: bool, minimum_reusable_offset: int, header_bytes: int, nbytes: int,
            last_modified: float) -> None:
        """Record an entry (its tokens digested here and not kept); merged into
        the lookups at the next ``flush`` or lookup. An id is added once (learn
        adds only headers it does not know)."""
        chain = self.prompt_digests(tokens, ns)
        whole = self._whole(tokens, ns)
        names = np.fromiter((name_hint(b) for b in dict.fromkeys(blocks)), np.uint64)
        hi, lo = _id_parts(entry_id)
        with self._lock:
            ns_index = self._ns_index.setdefault(ns, len(self._ns_names))
            if ns_index == len(self._ns_names):
                self._ns_names.append(ns)
            slot = self._records.append((hi, lo, ns_index, len(tokens), minimum_reusable_offset, header_bytes,
                                         nbytes, last_modified, trimmable, True))
            self._live += 1
            self._ids.add(np.array([hi], np.uint64), slot)
            self._chain.add(chain, slot)
            self._exact.add(np.array([whole], np.uint64), slot)
            self._blocks.add(names, slot)

    def drop(self, entry_id: str) -> None:
        for slot in self._slots(entry_id):
            with self._lock:
                if self._records.rows["live"][slot]:
                    self._records.rows["live"][slot] = False
                    self._live -= 1
                    self._dead.append(slot)

    def flush(self) -> None:
        """Merge what was added into the sorted arrays; compact them once enough
        of their rows belong to forgotten entries."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        rows = (self._ids, self._chain, self._exact, self._blocks)
        for r in rows:
            r.flush()
        if self._dead and len(self._dead) * _COMPACT_FRACTION > self._live:
            dead = np.array(self._dead, np.uint32)
            for r in rows:
                r.drop(dead)
            self._dead = []

    def _live_entries(self, slots: np.ndarray) -> list[RemoteEntry]:
        live = self._records.rows["live"]
        return [self._entry(int(s)) for s in slots if live[s]]

    # -- lookups ---------------------------------------------------------------
    def levels(self, tokens: np.ndarray, ns: str) -> Iterator[tuple[int, Iterator[RemoteEntry]]]:
        """(k, entries) for each k, deepest first, such that the entries share
        the first k whole blocks of ``tokens`` (by digest) and not the next:
        each one's common prefix with ``tokens`` is at least ``k * block_tokens``
        and less than ``(k + 1) * block_tokens``. Earliest learned first, each
        made only when the caller asks for it (a system prompt's level may hold
        most of the fleet)."""
        digests = self.prompt_digests(tokens, ns)
        with self._lock:
            self._flush()
            present = np.flatnonzero(self._chain.present(digests))
        deeper = np.empty(0, np.uint32)
        for i in present[::-1]:
            with self._lock:
                slots = self._chain.slots_of(digests[i])
            here = slots[~np.isin(slots, deeper)]  # levels nest: the one below holds every deeper entry
            deeper = slots
            if len(here):
                yield int(i) + 1, self._made(here)

    def _made(self, slots: np.ndarray) -> Iterator[RemoteEntry]:
        for slot in slots:
            with self._lock:
                entry = self._entry(int(slot)) if self._records.rows["live"][slot] else None
            if entry is not None:
                yield entry

    def exact(self, tokens: np.ndarray, ns: str) -> list[RemoteEntry]:
        """The entries whose tokens are ``tokens`` in ``ns`` (by digest: the caller compares tokens)."""
        whole = self._whole(tokens, ns)
        with self._lock:
            self._flush()
            return [e for e in self._live_entries(self._exact.slots_of(whole)) if e.ns == ns]

    def at_depth(self, tokens: np.ndarray, ns: str, k: int) -> list[RemoteEntry]:
        """The entries that share the first ``k`` whole blocks of ``tokens`` (k >= 1)."""
        digests = self.prompt_digests(tokens[: k * self.block_tokens], ns)
        if len(digests) < k:
            return []
        with self._lock:
            self._flush()
            return self._live_entries(self._chain.slots_of(digests[k - 1]))

    def unknown_blocks(self, names: Sequence[str]) -> set[str]:
        """Those of ``names`` no entry of the catalog references (a hint: a
        name sharing its first 8 bytes with another's counts as known)."""
        if not names:
            return set()
        keys = np.fromiter((name_hint(n) for n in names), np.uint64, len(names))
        with self._lock:
            self._flush()
            live = self._records.rows["live"]
            known = self._blocks.present(keys)
            return {n for n, k, seen in zip(names, keys, known)
                    if not seen or not live[self._blocks.slots_of(k)].any()}
