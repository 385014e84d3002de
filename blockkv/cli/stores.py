"""Opening a local store for the commands that may change one (``check
--repair``, ``gc``, ``rebuild-index``, ``evict``) so that opening deletes
nothing, and the store's ``DEFAULT_GC_GRACE`` for what they print. The one
CLI module that imports ``blockkv.store``, so the read-only commands need not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from blockkv.local.directory import FingerprintDir
from blockkv.store import DEFAULT_GC_GRACE, BlockStore


@contextmanager
def open_store(fp: FingerprintDir, gc_grace: float | None = None) -> Iterator[BlockStore]:
    """Open a fingerprint directory so that opening itself deletes nothing (no
    block or tmp-file sweep), whatever the command: what a command deletes is
    then exactly what it reports. ``gc_grace`` (None: the store's default) is
    the grace the command's own gc and eviction then use."""
    never = float("inf")
    with BlockStore.open_dir(fp.path, gc_grace=never, tmp_grace=never) as store:
        store.gc_grace = DEFAULT_GC_GRACE if gc_grace is None else gc_grace
        yield store

