"""The local disk as the store's first tier: an entry read back.

``EntryRead`` (restore.py) reads it; a block that fails its hash is healed
once from the tier behind the disk (``heal``: the bucket's verified copy, if
there is one) and the entry read again; any other failure is a miss, and
what it proves is ``Retention.restore_failed``'s to act on. A read that
succeeds is a use: recorded in the header's mtime (the truth a rebuild reads)
and the catalog's LRU. Its ``restore`` answers as the bucket's tier does
(``Restored``, tiers.py), with nothing to adopt: the store reads either the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockkv.errors import CorruptBlockError, CorruptError
from blockkv.format.header import Header, Identity
from blockkv.local.adoptions import Adoption
from blockkv.local.directory import Directory
from blockkv.local.executors import Executors
from blockkv.local.restore import EntryRead
from blockkv.local.retention import Retention
from blockkv.records import Entry

Read = tuple[Header, list[Any], dict[str, Any], int]  # header, caches, attachments, block bytes read
Restored = tuple[Read, Adoption | None]  # what a tier read, and what to keep locally of what it fetched
Heal = Callable[[Entry, str], bool]  # (entry, block) -> the block was replaced by a verified copy


class DiskTier:
    def __init__(self, directory: Directory, identity: Identity, verify: bool | str, executor: Executors,
                 retention: Retention, heal: Heal, clock: Callable[[], float], stats: dict[str, float]) -> None:
        self._dir, self._identity, self._verify, self._executor = directory, identity, verify, executor
        self._retention, self._heal, self._clock, self._stats = retention, heal, clock, stats

    def restore(self, entry: Entry, cut: int | None) -> Restored | None:
        """``entry``'s caches cut to ``cut`` tokens (None: whole), with the block
        bytes read, and nothing to adopt; None (a miss) on any failure."""
        for attempt in range(2):
            read = EntryRead(self._dir, self._identity, entry, self._verify, self._executor("read"),
                             self._executor("alloc"))
            try:
                header, caches, attachments = read.run(cut)
                break
            except Exception as exc:  # noqa: BLE001 - a restore must never take serving down
                if isinstance(exc, CorruptError):
                    self._stats["verify_failures"] += 1
                culprit = read.culprit(exc)
                healable = attempt == 0 and isinstance(exc, CorruptBlockError) and culprit not in ("", "header")
                if healable and self._heal(entry, culprit):
                    continue  # the bucket's verified copy replaced a rotten local block: read again
                self._retention.restore_failed(entry, exc, culprit)
                return None
        now = self._clock()
        self._dir.mark_used(self._dir.header_path(entry.ns, entry.id), now)  # the truth a rebuild reads
        self._retention.used(entry.id, now)
        return (header, caches, attachments, read.bytes_read), None
