"""The remote tier's circuit breaker: during an outage the bucket is skipped, not waited on."""

from __future__ import annotations

import threading
import time


class Breaker:
    """After a failure, skip the bucket for a backoff that doubles (up to ``cap``)
    until a call succeeds: an unreachable bucket costs one failed request per
    backoff period, not a timeout per store or restore."""

    def __init__(self, first: float = 2.0, cap: float = 60.0) -> None:
        self._first, self._cap = first, cap
        self._backoff = 0.0
        self._until = 0.0
        self._mutex = threading.Lock()

    def is_open(self) -> bool:
        return time.monotonic() < self._until

    def failed(self) -> None:
        with self._mutex:
            self._backoff = min(self._cap, self._backoff * 2 or self._first)
            self._until = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        with self._mutex:
            self._backoff = 0.0
            self._until = 0.0
