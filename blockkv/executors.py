"""One store handle's worker threads, a pool per kind of job, so that a
restore never queues behind a store."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_IO_THREADS = 2  # fsyncs of different files overlap; more did not help on 2 cores
_READ_THREADS = 4  # a cold restore keeps more reads in flight; a warm one is CPU-bound either way


class Executors:
    """Made on first use: "store" and "restore" (the async calls), one thread
    each; "io" (a store's block writes), "hash" (a store's block hashing), two threads each, and
    "read" (a restore's block reads and checks), four."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def __call__(self, job: str) -> ThreadPoolExecutor:
        with self._mutex:
            pool = self._pools.get(job)
            if pool is None:
                workers = {"io": _IO_THREADS, "hash": _IO_THREADS, "read": _READ_THREADS}.get(job, 1)
                pool = self._pools[job] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"blockkv-{job}")
            return pool

    def shutdown(self) -> None:
        """Pending jobs finish first."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
