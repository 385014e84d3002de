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

The index's transaction lock (``TxnLock``) is a flock too, for the same
reason: LMDB is opened without its own lock, whose cross-process writer lock
is a POSIX semaphore on macOS that a SIGKILLed holder never releases.
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
        self._fd = _open_lock_file(path, create)
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
        _flock_until(self._fd, mode, deadline, self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _open_lock_file(path: Path, create: bool) -> int:
    """A lock file's fd (read-write, created if missing; read-only with
    ``create=False``). One this user may not open says whose problem it is."""
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{exc.strerror}: a blockkv lock file this user may not open, likely "
                              "made by another user (blockkv run with sudo on this cache?); give the cache back "
                              "to its owner (chown -R)", str(path)) from None


def _flock_until(fd: int, mode: int, deadline: float | None, path: Path) -> None:
    """``flock(fd, mode)``, waiting at most until ``deadline`` (None: forever)."""
    if deadline is None:
        fcntl.flock(fd, mode)
        return
    pause = _POLL_START
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(f"{path}: held by another process for longer than the timeout")
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX)


class TxnLock:
    """An LMDB environment's transaction lock, across threads and processes:
    ``flock`` on a file in the environment's directory, shared while any
    thread of this process is inside a read transaction, exclusive while one
    is inside a write transaction (or resizes the map).

    The environment is opened without LMDB's own lock (``lock=False``), so
    this is the only one: a SIGKILLed holder's flock is released by the
    kernel on every platform. Without LMDB's reader table a writer may reuse
    any page no committed state needs, including pages a reader in another
    process is still walking; holding the shared lock for the whole life of
    every read transaction is what keeps a writer out until it ends. Every
    wait is bounded (``LockTimeout``): a transaction holds the lock for
    milliseconds, only a stopped process holds it longer.

    ``create=False``: a tool that only reads opens an existing file read-only
    (FileNotFoundError if there is none)."""

    def __init__(self, path: Path, *, timeout: float, create: bool = True) -> None:
        self.path = path
        self.timeout = timeout
        self._fd = _open_lock_file(path, create)
        self._cond = threading.Condition()
        self._readers = 0  # threads of this process inside a read transaction
        self._writing = False  # a thread of this process holds (or is taking) the lock exclusively
        self._taking = False  # a reader is taking the shared flock for this process
        forget_in_forked_child(self)

    def _forget_inherited(self) -> None:
        """In a forked child: close our copy of the file (the parent's lock stays)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self._cond, self._readers, self._writing, self._taking = threading.Condition(), 0, False, False

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(f"{self.path}: another thread of this process held the lock past the timeout")
        self._cond.wait(left)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """For one read transaction: the first reader of this process takes the
        shared flock, the last lets it go."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._writing or self._taking:
                self._wait(deadline)
            first = self._readers == 0
            if first:
                self._taking = True
            else:
                self._readers += 1
        if first:
            try:
                _flock_until(self._fd, fcntl.LOCK_SH, deadline, self.path)
            except BaseException:
                with self._cond:
                    self._taking = False
                    self._cond.notify_all()
                raise
            with self._cond:
                self._taking = False
                self._readers += 1
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """For one write transaction (or a map resize): no other transaction
        in this process or any other."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._writing or self._taking or self._readers:
                self._wait(deadline)
            self._writing = True
        try:
            _flock_until(self._fd, fcntl.LOCK_EX, deadline, self.path)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
