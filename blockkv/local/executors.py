"""One store handle's worker threads, a pool per kind of job, so that a
restore never queues behind a store."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_WORKERS = {
    "io": 4,  # a store's block writes: each ends in an fsync that waits on the disk, not a core; a
    # 1024-token entry's 4 blocks written on 4 threads wait for one fsync, not two in turn
    # (4096 tokens: 0.76x -> 1.32x mlx-lm's save + fsync, alternating, load ~8)
    "hash": 2,  # a store's block hashing: one per core
    "read": 2,  # a restore's block reads and checks: one per core (four read no faster)
    "alloc": 1,  # a restore's destination arrays: always one thread, whose arena keeps freed pages (restore.py)
}


class Executors:
    """Made on first use: "store" and "restore" (the async calls), one thread
    each; "io" (a store's block writes), four; "hash" (a store's block
    hashing) and "read" (a restore's block reads and checks), two each;
    "alloc" (a restore's destination arrays), one."""

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
