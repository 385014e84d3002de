"""An indexed entry's tokens and block names read back from its header file,
with no lock: what the catalog's tries compare and what ``find`` hands out
once the catalog is loaded (issue #45), without waiting on the index's
transaction lock (issue #43: a process stopped inside a write transaction
must not delay a lookup).

A header is immutable once committed: written to a temp file, renamed into
place, only ever deleted (entry ids are never reused), so reading it needs no
lock; one deleted under us (another process removed its entry) reads as
gone. What is read is checked against what the catalog knows of the entry
from the index: the file's size (so a read is bounded by the header the index
recorded, never more than ``MAX_HEADER_BYTES``), its token count, and a 64-bit
xxh3 digest of its tokens taken when the entry was loaded. A header damaged
or replaced in its tokens so reads as gone, never as other tokens: a trie
label is the tokens the trie was built from, or nothing. The digest is not a
MAC: a writer of the directory could aim a collision, but such a writer can
plant a whole header with caches for any tokens anyway (design.md, "The
in-memory catalog").

The last-read headers are kept in a small LRU, at most ``CACHE_BYTES``
whatever the catalog's size: the labels near a trie's root (a shared system
prompt) are read by nearly every lookup, and a lookup's match was read by its
walk just before it is handed out.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash

from blockkv.errors import BlockKVError
from blockkv.format.header import decode_header, framed_tokens
from blockkv.local.directory import Directory
from blockkv.records import Entry

log = logging.getLogger(__name__)

CACHE_BYTES = 4 << 20  # recently read header files kept, whatever the catalog's size


def tokens_digest(tokens: np.ndarray) -> int:
    """What a header's tokens are checked against (the indexed tokens' digest)."""
    data: Any = np.ascontiguousarray(tokens, "<u4")  # a buffer: hashed in place, not copied
    return xxhash.xxh3_64_intdigest(data)


class HeaderPages:
    """Entries' tokens from their headers, checked against the digests taken
    of their indexed tokens (``follow``). Thread-safe."""

    def __init__(self, directory: Directory, cache_bytes: int = CACHE_BYTES) -> None:
        self._dir = directory
        self._digests: dict[str, int] = {}  # the catalog's (``follow``)
        self._cache: OrderedDict[str, bytes] = OrderedDict()  # checked header files, least recently read first
        self._cached = 0  # bytes in _cache
        self._cache_bytes = cache_bytes
        self._mutex = threading.Lock()
        self._warned = False  # an unexpected read failure was logged

    def follow(self, digests: dict[str, int]) -> None:
        """Check against ``digests`` from now on (the catalog's, of each entry's
        indexed tokens: it adds and removes them as it follows the index)."""
        with self._mutex:
            self._digests, self._cache, self._cached = digests, OrderedDict(), 0

    def forget(self, entry_id: str) -> None:
        """Let go of a removed entry's header now (not only once the LRU would)."""
        with self._mutex:
            data = self._cache.pop(entry_id, None)
            if data is not None:
                self._cached -= len(data)

    def tokens(self, entry: Entry) -> np.ndarray | None:
        """``entry``'s tokens (read-only), or None if its header is gone or not
        the one indexed."""
        data = self._checked(entry)
        return framed_tokens(data) if data is not None else None

    def holding(self, entry: Entry) -> Entry | None:
        """A copy of ``entry`` holding its header's bytes: its tokens (checked)
        and, parsed when asked, its block names (``HeldHeader``). What a lookup
        hands out; None if the header is gone or not the one indexed."""
        data = self._checked(entry)
        tokens = framed_tokens(data) if data is not None else None
        return entry.holding(tokens, HeldHeader(self._dir, data)) if data is not None and tokens is not None else None

    def _checked(self, entry: Entry) -> bytes | None:
        """The header file's bytes, if they are the ones indexed (kept in the LRU)."""
        with self._mutex:
            data = self._cache.get(entry.id)
            if data is not None:
                self._cache.move_to_end(entry.id)
                return data
        data = self._read(entry)
        tokens = framed_tokens(data) if data is not None else None
        if data is None or tokens is None or not self._indexed(entry, tokens):
            return None
        self._keep(entry.id, data)
        return data

    def _read(self, entry: Entry) -> bytes | None:
        """The header file's bytes, if it is the size the index recorded."""
        try:
            data = self._dir.fs.read(self._dir.header_path(entry.ns, entry.id), limit=entry.header_bytes)
        except (OSError, MemoryError, BlockKVError):  # gone, or unreadable now: the caller's fallback decides
            return None
        except Exception as exc:  # noqa: BLE001 - e.g. a caller's FileLayer failing: a lookup misses, never raises
            if not self._warned:
                self._warned = True
                log.warning("blockkv: reading a header for a lookup failed (%r); such lookups are misses", exc)
            return None
        return data if len(data) == entry.header_bytes else None

    def _indexed(self, entry: Entry, tokens: np.ndarray) -> bool:
        with self._mutex:
            digest = self._digests.get(entry.id)
        return digest is not None and len(tokens) == entry.length and digest == tokens_digest(tokens)

    def _keep(self, entry_id: str, data: bytes) -> None:
        if len(data) > self._cache_bytes:
            return
        with self._mutex:
            if entry_id in self._cache or entry_id not in self._digests:  # forgotten meanwhile: not kept
                return
            self._cache[entry_id] = data
            self._cached += len(data)
            while self._cached > self._cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= len(old)


class HeldHeader:
    """The header bytes a handed-out entry holds (``records.Paged``): its
    tokens, checked when read, and its block names, parsed the first time they
    are asked for (its whole digest checked then): a lookup does not parse a
    descriptor nobody reads. ``KeyError`` if they do not parse."""

    def __init__(self, directory: Directory, data: bytes) -> None:
        self._dir, self._data = directory, data
        self._blocks: tuple[str, ...] | None = None

    def tokens(self, entry_id: str) -> np.ndarray:
        tokens = framed_tokens(self._data)
        if tokens is None:
            raise KeyError(f"entry {entry_id}: its header is not one")
        return tokens

    def blocks(self, entry_id: str) -> tuple[str, ...]:
        if self._blocks is None:
            try:
                header = decode_header(self._data)
                path = self._dir.header_path(header.ns, entry_id)
                self._blocks = self._dir.record(entry_id, path, header, len(self._data)).blocks
            except Exception as exc:  # noqa: BLE001 - what a damaged header says is no block name
                raise KeyError(f"entry {entry_id}: its header names no blocks that can be read ({exc})") from None
        return self._blocks
