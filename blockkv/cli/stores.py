"""Opening a local store for the commands that may change one (``check
--repair``, ``gc``, ``rebuild-index``, ``evict``) so that opening deletes
nothing, and the store's own default grace for what they print. The one CLI
module that imports ``blockkv.store``, so the read-only commands need not.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from blockkv.local.directory import FingerprintDir
from blockkv.store import BlockStore


@contextmanager
def open_store(fp: FingerprintDir, gc_grace: float | None = None) -> Iterator[BlockStore]:
    """Open a fingerprint directory so that opening itself deletes nothing (no
    block or tmp-file sweep), whatever the command: what a command deletes is
    then exactly what it reports. ``gc_grace`` (None: the store's default) is
    the grace the command's own gc and eviction then use."""
    never = float("inf")
    with BlockStore.open_dir(fp.path, gc_grace=never, tmp_grace=never) as store:
        store.gc_grace = default_gc_grace() if gc_grace is None else gc_grace
        yield store


def default_gc_grace() -> float:
    """The store's own default grace, so the CLI never drifts from it."""
    return float(inspect.signature(BlockStore).parameters["gc_grace"].default)
