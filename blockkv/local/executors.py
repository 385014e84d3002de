"""One store handle's worker threads, a pool per kind of job, so that a
restore never queues behind a store."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_IO_THREADS = 2  # fsyncs of different files overlap; more did not help on 2 cores


class Executors:
    """Made on first use: "store" and "restore" (the async calls), one thread
    each; "io" (a store's block writes), "hash" (a store's block hashing) and
    "read" (a restore's block reads and checks), two threads each."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def __call__(self, job: str) -> ThreadPoolExecutor:
        with self._mutex:
            pool = self._pools.get(job)
            if pool is None:
                workers = _IO_THREADS if job in ("io", "hash", "read") else 1
                pool = self._pools[job] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"blockkv-{job}")
            return pool

    def shutdown(self) -> None:
        """Pending jobs finish first."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
