"""Lookups in the remote catalog, settled by headers (issue #23).

The catalog knows, by digest, which entries share a prompt's whole blocks
(remote_catalog.py); how many tokens each really shares — the partial block, the
exact common prefix, whether it can be cut there — is in its header. A
lookup reads the headers of the deepest candidates (at most ``READ_LIMIT``,
of at most ``SCAN_LIMIT`` looked at) from the node's header cache on disk
and applies the store's ``find`` rules to their tokens, exactly as the local
trie does: the longest usable prefix, capped at all but the last token; never
one an entry cannot be cut to; the earliest learned on a tie. Candidates
beyond the limits share the same whole blocks as those read and could be
longer by less than one block; they are not read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from blockkv.bucket.bucket_dir import HeaderCopy
from blockkv.errors import (
    BlockMissingError,
    CorruptError,
    CorruptHeaderError,
    NewerFormatError,
)
from blockkv.format.header import Header
from blockkv.format.layout import header_name
from blockkv.local.prefix_index import common_prefix_length
from blockkv.records import Entry, Match
from blockkv.remote.remote_catalog import RemoteCatalog, RemoteEntry

READ_LIMIT = 4  # headers one lookup reads, at most
SCAN_LIMIT = 64  # candidates one lookup looks at, at most
RECENT_COPIES = 64  # header copies kept in memory: the node's working set of remote entries
RECENT_BYTES = 64 << 20


class RecentHeaders:
    """The last header copies read, by name, bounded in count and bytes."""

    def __init__(self) -> None:
        self._copies: OrderedDict[str, HeaderCopy] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, name: str) -> HeaderCopy | None:
        with self._lock:
            copy = self._copies.get(name)
            if copy is not None:
                self._copies.move_to_end(name)
            return copy

    def put(self, name: str, copy: HeaderCopy) -> None:
        with self._lock:
            old = self._copies.pop(name, None)
            self._bytes -= len(old.data) if old is not None else 0
            self._copies[name] = copy
            self._bytes += len(copy.data)
            while self._copies and (len(self._copies) > RECENT_COPIES or self._bytes > RECENT_BYTES):
                self._bytes -= len(self._copies.popitem(last=False)[1].data)

    def drop(self, name: str) -> None:
        with self._lock:
            old = self._copies.pop(name, None)
            self._bytes -= len(old.data) if old is not None else 0


class Lookup:
    """``find``, ``find_exact`` and ``has_durable_prefix`` over the remote catalog.
    ``header(name)`` is header ``name`` with its checksum verified (the whole
    header is verified, descriptor and all, before a restore uses it);
    ``unusable(entry, exc)`` is told of one that proved bad."""

    def __init__(self, catalog: RemoteCatalog, header: Callable[[str], Header],
                 unusable: Callable[[RemoteEntry, Exception], None]) -> None:
        self._catalog, self._header, self._unusable = catalog, header, unusable

    def entry(self, record: RemoteEntry) -> Entry | None:
        """The entry as ``find`` hands it out (its tokens and block names from
        its header), or None if its header proves unusable."""
        try:
            header = self._header(header_name(record.ns, record.id))
            d = header.descriptor
            blocks = tuple(dict.fromkeys([r[0] for r in d["token_blocks"]] + [r[0] for r in d["state_blocks"]]))
            attachments = tuple(d["attachments"])
            if not all(isinstance(b, str) for b in blocks) or header.ns != record.ns:
                raise CorruptHeaderError("its descriptor does not name its blocks")
        except (BlockMissingError, CorruptError, NewerFormatError) as exc:
            self._unusable(record, exc)
            return None
        except (KeyError, TypeError, IndexError) as exc:
            self._unusable(record, CorruptHeaderError(f"its descriptor does not name its blocks ({exc!r})"))
            return None
        return Entry(record.id, record.ns, header.tokens, record.nbytes, record.header_bytes, blocks,
                     record.last_modified, record.trimmable, record.minimum_reusable_offset, None, attachments)

    def find(self, tokens: np.ndarray, ns: str, floor: int = 0) -> Match | None:
        """The longest usable match longer than ``floor`` tokens (the local one's)."""
        cap, size = len(tokens) - 1, self._catalog.block_tokens
        best: Entry | None = None
        best_p, reads, scanned = floor, 0, 0
        for k, candidates in self._catalog.levels(tokens, ns):
            if min(cap, (k + 1) * size - 1) <= best_p or reads >= READ_LIMIT or scanned >= SCAN_LIMIT:
                break
            for record in candidates:
                scanned += 1
                if scanned > SCAN_LIMIT:
                    break
                upper = min(cap, (k + 1) * size - 1, record.length)
                if upper <= best_p or upper < record.minimum_reusable_offset:
                    continue
                if not record.trimmable and record.length > upper:  # it could only be served whole
                    continue
                if reads >= READ_LIMIT:
                    break
                reads += 1
                entry = self.entry(record)
                if entry is None:
                    continue
                p = min(common_prefix_length(entry.token_array, tokens), cap)
                if p > best_p and p >= record.minimum_reusable_offset and (p == record.length or record.trimmable):
                    best, best_p = entry, p
            if best is not None:
                break
        return Match(best, best_p) if best is not None else None

    def find_exact(self, tokens: np.ndarray, ns: str) -> Match | None:
        for record in self._catalog.exact(tokens, ns)[:READ_LIMIT]:
            entry = self.entry(record)
            if entry is not None and np.array_equal(entry.token_array, tokens):
                return Match(entry, len(tokens))
        return None

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        """Some entry has ``tokens`` as a prefix and can be cut back to exactly
        it (prefixes shorter than one block are not looked for)."""
        n = len(tokens)
        k = n // self._catalog.block_tokens
        if k == 0:
            return False
        usable = [r for r in self._catalog.at_depth(tokens, ns, k)
                  if r.length >= n >= r.minimum_reusable_offset and (r.length == n or r.trimmable)]
        for record in usable[:READ_LIMIT]:
            entry = self.entry(record)
            if entry is not None and np.array_equal(entry.token_array[:n], tokens):
                return True
        return False
