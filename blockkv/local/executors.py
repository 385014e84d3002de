"""One store handle's worker threads, a pool per kind of job, so that a
restore never queues behind a store."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_MAX_CORE_THREADS = 8  # past this a handle's hashing or reading would crowd out the model it serves


def core_threads() -> int:
    """Threads for work that keeps a core busy (hashing, reading and checking
    blocks): one per core this process may run on, at least 2 (the count
    measured on 2 cores), at most ``_MAX_CORE_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        cores = os.cpu_count() or 2
    return max(2, min(cores, _MAX_CORE_THREADS))


_WORKERS = {
    "io": 4,  # a store's block writes: each ends in an fsync that waits on the disk, not a core; a
    # 1024-token entry's 4 blocks written on 4 threads wait for one fsync, not two in turn
    # (4096 tokens: 0.76x -> 1.32x mlx-lm's save + fsync, alternating, load ~8)
    "hash": core_threads(),  # a store's block hashing: one per core
    # a restore's block reads and checks: at least four, so that a cold read keeps the disk busy while
    # other threads check (2 cores, one process, alternating: cold 8k 171 -> 162 ms, 32k 797 -> 730;
    # warm 8,704 tokens 62 -> 56 ms); one per core past four
    "read": max(4, core_threads()),
    "alloc": 1,  # a restore's destination arrays: always one thread, whose arena keeps freed pages (restore.py)
}


class Executors:
    """Made on first use: "store" and "restore" (the async calls), one thread
    each; "io" (a store's block writes), four; "hash" (a store's block
    hashing), one per core (``core_threads``); "read" (a restore's block
    reads and checks), one per core but at least four; "alloc" (a restore's
    destination arrays), one."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def __call__(self, job: str) -> ThreadPoolExecutor:
        with self._mutex:
            pool = self._pools.get(job)
            if pool is None:
                workers = _WORKERS.get(job, 1)
                pool = self._pools[job] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"blockkv-{job}")
            return pool

    def shutdown(self) -> None:
        """Pending jobs finish first."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
