"""Entries a restore fetched from the bucket, made local in the background.

A restore of an entry only the bucket holds returns once its caches are
filled; what it fetched is then kept by the write order of a store
(``Commits.adopt``) on a thread of its own, from the verified frames in
memory (nothing is read again). Writing them while the fetches were still in
flight cost the restore a fifth of its time (docs/scale-out.md, "Restore").
``wait_kept`` waits for them: before another restore of the same entry, a store
that may continue it, a listing of the bucket, and close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from blockkv.format.header import Header
from blockkv.local.commit import Commits
from blockkv.local.retention import Settings
from blockkv.records import Entry


@dataclass(frozen=True)
class Adoption:
    """What a node keeps of a remote entry it restored: an entry to write locally."""

    entry_id: str | None  # None: a new id, minted by the store that keeps it
    header: Header
    encoded: bytes
    whole: bool  # the bucket's entry itself (else a prefix entry of this node's own)
    frame_of: Callable[[str], bytes | memoryview]  # a block's verified frame, from the restore's memory


class Adoptions:
    """One handle's adoptions, one at a time. Once an adopted entry is visible,
    under the lock, ``landed(entry_id)`` applies the store's rules and
    ``replaced`` is handed the entries they removed (the tier deletes its copies)."""

    def __init__(self, commits: Commits, settings: Settings, landed: Callable[[str], list[Entry]],
                 replaced: Callable[[Iterable[Entry]], None]) -> None:
        self._commits, self._settings = commits, settings
        self._landed, self._replaced = landed, replaced
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="blockkv-adopt")
        self._mutex = threading.Lock()
        self._pending: dict[str, Future[None]] = {}  # remote entry id -> its adoption in flight

    def submit(self, remote_id: str, adoption: Adoption, adopted: Callable[[str], None]) -> None:
        """Keep ``adoption`` (fetched by a restore of ``remote_id``) in the
        background; ``adopted(remote_id)`` once the bucket's entry itself is local."""
        def adopt() -> None:
            try:
                if self._commits.adopt(adoption.entry_id, adoption.header, adoption.encoded, adoption.frame_of,
                                       self._settings.max_bytes, self._rules) and adoption.whole:
                    adopted(remote_id)  # an ordinary local entry from now on
            finally:
                with self._mutex:
                    if self._pending.get(remote_id) is future:
                        del self._pending[remote_id]

        with self._mutex:
            try:
                future = self._thread.submit(adopt)
            except RuntimeError:  # closing: the restore is served, nothing kept
                return
            self._pending[remote_id] = future

    def _rules(self, entry_id: str) -> None:
        self._replaced(self._landed(entry_id))

    def wait_kept(self, remote_id: str | None = None) -> None:
        """Wait until what restores fetched is kept locally (of ``remote_id``, or of every entry)."""
        with self._mutex:
            pending = [f for i, f in self._pending.items() if remote_id is None or i == remote_id]
        for future in pending:
            future.exception()  # adoption failures are warned about where they happen

    def close(self) -> None:
        self._thread.shutdown(wait=True)
