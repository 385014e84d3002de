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

The last-read entries' tokens are kept in a small LRU, at most
``CACHE_BYTES`` whatever the catalog's size: the labels near a trie's root
(a shared system prompt) are read by nearly every lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash

from blockkv.errors import BlockKVError
from blockkv.format.header import decode_header, framed_tokens
from blockkv.local.directory import Directory
from blockkv.records import Entry

CACHE_BYTES = 4 << 20  # tokens kept of recently read headers, whatever the catalog's size


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
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached = 0  # bytes in _cache
        self._cache_bytes = cache_bytes
        self._mutex = threading.Lock()

    def follow(self, digests: dict[str, int]) -> None:
        """Check against ``digests`` from now on (the catalog's, of each entry's
        indexed tokens: it adds and removes them as it follows the index)."""
        with self._mutex:
            self._digests, self._cache, self._cached = digests, OrderedDict(), 0

    def forget(self, entry_id: str) -> None:
        """Let go of a removed entry's tokens now (not only once the LRU would)."""
        with self._mutex:
            cached = self._cache.pop(entry_id, None)
            if cached is not None:
                self._cached -= cached.nbytes

    def tokens(self, entry: Entry) -> np.ndarray | None:
        """``entry``'s tokens (read-only), or None if its header is gone or not
        the one indexed."""
        with self._mutex:
            cached = self._cache.get(entry.id)
            if cached is not None:
                self._cache.move_to_end(entry.id)
                return cached
        data = self._read(entry)
        tokens = framed_tokens(data) if data is not None else None
        if tokens is None or not self._indexed(entry, tokens):
            return None
        tokens = tokens.copy()  # not a view: the header's other bytes are not kept
        tokens.flags.writeable = False
        self._keep(entry.id, tokens)
        return tokens

    def holding(self, entry: Entry) -> Entry | None:
        """A copy of ``entry`` holding its tokens and block names, read from its
        verified header (its whole digest checked, its descriptor parsed): what
        a lookup hands out. None if the header is gone or not the one indexed."""
        data = self._read(entry)
        if data is None:
            return None
        try:
            header = decode_header(data)
            if not self._indexed(entry, header.tokens) or header.ns != entry.ns:
                return None
            path = self._dir.header_path(entry.ns, entry.id)
            record = self._dir.record(entry.id, path, header, len(data))
        except Exception:  # noqa: BLE001 - a header a lookup cannot read is one it does not hand out
            return None
        return entry.holding(record.tokens, record.blocks)

    def _read(self, entry: Entry) -> bytes | None:
        """The header file's bytes, if it is the size the index recorded."""
        try:
            data = self._dir.fs.read(self._dir.header_path(entry.ns, entry.id), limit=entry.header_bytes)
        except (OSError, MemoryError, BlockKVError):  # gone, or unreadable now: the caller's fallback decides
            return None
        return data if len(data) == entry.header_bytes else None

    def _indexed(self, entry: Entry, tokens: np.ndarray) -> bool:
        with self._mutex:
            digest = self._digests.get(entry.id)
        return digest is not None and len(tokens) == entry.length and digest == tokens_digest(tokens)

    def _keep(self, entry_id: str, tokens: np.ndarray) -> None:
        if tokens.nbytes > self._cache_bytes:
            return
        with self._mutex:
            if entry_id in self._cache or entry_id not in self._digests:  # forgotten meanwhile: not kept
                return
            self._cache[entry_id] = tokens
            self._cached += tokens.nbytes
            while self._cached > self._cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
