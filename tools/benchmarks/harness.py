"""What every section measures with, so that its figures compare: a store opened
the same way each time (no practical byte cap, verify on, no compression),
median wall times and percentiles, this process's /proc/self/io deltas; and the
paths of the repository and of the entry point, which child processes run."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from blockkv import BlockStore
from blockkv.fs import FileLayer

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent
ENTRY_POINT = TOOLS / "bench.py"  # what child processes run, with a hidden flag
MIB = 1 << 20

STORE_IDENTITY = {
    "model_id": "bench/llama-3.2-1b-shaped",
    "config_fingerprint": "bench-bf16",
    "tokenizer_hash": "bench-tokenizer",
}


def open_store(
    root: Path,
    block_tokens: int,
    fs: FileLayer | None = None,
    gc_grace: float = 60.0,
    verify: bool | str = True,
    **identity: str,
) -> BlockStore:
    """A store with no practical byte cap, verify on (default: xxh3-128), no compression."""
    return BlockStore(
        root,
        max_bytes=1 << 50,
        block_tokens=block_tokens,
        fs=fs,
        gc_grace=gc_grace,
        verify=verify,
        **(identity or STORE_IDENTITY),
    )


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io (write_bytes counts pages dirtied for the disk)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


@contextmanager
def io_delta(out: dict[str, int]) -> Iterator[None]:
    """Add this block's /proc/self/io deltas into ``out``."""
    before = io_counters()
    yield
    after = io_counters()
    for k, v in after.items():
        out[k] = out.get(k, 0) + v - before[k]


def median_time(
    fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None
) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` runs (``setup()`` untimed before each)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def drop_page_cache(root: Path) -> int:
    """Evict every file under ``root`` from the page cache; returns how many.
    Pages still dirty are not dropped, so each file is fsync'd first (the
    server's own writes are durable already: that is a no-op for them)."""
    n = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n
