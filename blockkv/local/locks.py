"""The directory lock: ``flock(2)`` on ``LOCK`` across processes, a lock per
handle across threads, and a timeout on both.

Exclusive for every mutation of the index or the files; shared for tools
that only need a consistent view (plain ``check``). flock is released by the
kernel when its process dies, so a SIGKILLed holder never wedges the
directory; a *stopped* or slow holder is why every wait is bounded: the
serving path gives up (``store`` → False) rather than hang behind it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blockkv.errors import LockTimeout

_POLL_START, _POLL_MAX = 0.001, 0.05


class DirLock:
    def __init__(self, path: Path, *, create: bool = True) -> None:
        """``create=False``: a tool that only looks opens an existing LOCK read-only."""
        self.path = path
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        self._fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._thread = threading.RLock()
        self._depth = 0
        self._mode = 0

    @contextmanager
    def held(self, timeout: float | None, *, shared: bool = False) -> Iterator[None]:
        """Hold the lock (re-entrant within a thread); ``LockTimeout`` after
        ``timeout`` seconds (None: wait forever). A thread already holding it
        exclusively may nest a shared request; not the other way round."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise LockTimeout(f"{self.path}: another thread of this process holds the lock")
        try:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            if self._depth == 0:
                self._flock(mode, deadline)
                self._mode = mode
            elif mode == fcntl.LOCK_EX and self._mode == fcntl.LOCK_SH:
                raise RuntimeError("cannot upgrade a shared directory lock")
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def _flock(self, mode: int, deadline: float | None) -> None:
        if deadline is None:
            fcntl.flock(self._fd, mode)
            return
        pause = _POLL_START
        while True:
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout(f"{self.path}: held by another process for longer than the timeout")
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)

    def close(self) -> None:
        os.close(self._fd)
