"""The directory lock: ``flock(2)`` on ``LOCK`` across processes, a lock per
handle across threads, and a timeout on both.

Exclusive for every mutation of the index or the files; shared for tools
that only need a consistent view (plain ``check``). flock is released by the
kernel when its process dies, so a SIGKILLed holder never wedges the
directory; a *stopped* or slow holder is why every wait is bounded: the
serving path gives up (``store`` → False) rather than hang behind it.

A flock belongs to an open file, which ``fork()`` shares with the child: a
child forked without exec while a store held the lock would hold it for as
long as it lived, the parent dead or not. So every holder of a kernel lock
(this lock, a writer's intent file) closes its copy of the file in a forked
child (``forget_in_forked_child``); the parent's lock is untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blockkv.errors import LockTimeout

_POLL_START, _POLL_MAX = 0.001, 0.05
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()  # what must let go of its kernel locks in a forked child


def forget_in_forked_child(holder: Any) -> None:
    """Call ``holder._forget_inherited()`` in every child this process forks:
    it closes the child's copies of its locked files (never unlocking them:
    that would unlock the parent's), so the locks live exactly as long as
    the parent. It must take no lock: the fork may have caught one held."""
    _HOLDERS.add(holder)


def _after_fork_in_child() -> None:
    for holder in list(_HOLDERS):
        holder._forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DirLock:
    def __init__(self, path: Path, *, create: bool = True) -> None:
        """``create=False``: a tool that only looks opens an existing LOCK read-only."""
        self.path = path
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        self._fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._thread = threading.RLock()
        self._depth = 0
        self._mode = 0
        forget_in_forked_child(self)

    def _forget_inherited(self) -> None:
        """In a forked child: close our copy of the file, whatever the parent holds."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self._thread, self._depth = threading.RLock(), 0

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
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
