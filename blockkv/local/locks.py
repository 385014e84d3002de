"""The directory lock: ``flock(2)`` on ``LOCK`` across processes, a lock per
handle across threads, and a timeout on both.

Exclusive for every mutation of the index or the files; shared for tools
that only need a consistent view (plain ``check``). flock is released by the
kernel when its process dies, so a SIGKILLed holder never wedges the
directory; a *stopped* or slow holder is why every wait is bounded: the
serving path gives up (``store`` → False) rather than hang behind it.

A lock file deleted or replaced on disk ("a stale lock file", to an
operator) is noticed each time it is taken: the descriptor's inode against
the path's. The lock is then let go, the path opened again and taken anew,
so a process that opens the new file and one that held the old never both
think they hold it from then on.

A flock belongs to an open file, which ``fork()`` shares with the child: a
child forked without exec while a store held the lock would hold it for as
long as it lived, the parent dead or not. So every holder of a kernel lock
(this lock, a writer's intent file) closes its copy of the file in a forked
child (``forget_in_forked_child``); the parent's lock is untouched.

The index's transaction lock (``TxnLock``) is a flock too, for the same
reason: LMDB is opened without its own lock, whose cross-process writer lock
is a POSIX semaphore on macOS that a SIGKILLed holder never releases.

``waiting_at_most`` bounds all the lock waits of a block of code together (a
query's refresh, a restore's bookkeeping, an open), ``each_wait_at_most``
each of them (a mutation's), whatever each lock's own timeout.
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
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from blockkv.errors import LockTimeout

_POLL_START, _POLL_MAX = 0.001, 0.05
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()  # what must let go of its kernel locks in a forked child
_DEADLINE: ContextVar[float | None] = ContextVar("blockkv_lock_deadline", default=None)
_EACH: ContextVar[float | None] = ContextVar("blockkv_lock_each", default=None)


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


@contextmanager
def waiting_at_most(seconds: float) -> Iterator[None]:
    """Inside, in this thread (or task), every wait for a lock ends ``seconds``
    from now at the latest (``LockTimeout``), whatever the lock's own timeout;
    nested bounds keep the tighter one. What never waits on a stopped process
    runs under one: a query's refresh, a restore's bookkeeping, an open."""
    deadline = time.monotonic() + max(seconds, 0.0)
    outer = _DEADLINE.get()
    token = _DEADLINE.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


@contextmanager
def each_wait_at_most(seconds: float) -> Iterator[None]:
    """Inside, in this thread (or task), each single wait for a lock lasts
    ``seconds`` at most, whatever the lock's own timeout: a mutation's
    ``lock_timeout`` bounds its transactions' waits as well as its wait for the
    directory lock. Nested bounds keep the tighter one."""
    outer = _EACH.get()
    token = _EACH.set(max(seconds, 0.0) if outer is None else min(outer, max(seconds, 0.0)))
    try:
        yield
    finally:
        _EACH.reset(token)


def deadline_for(timeout: float | None) -> float | None:
    """The monotonic time a wait of ``timeout`` seconds (None: forever) ends,
    tightened by any ``each_wait_at_most`` and ``waiting_at_most`` around it."""
    each = _EACH.get()
    if each is not None:
        timeout = each if timeout is None else min(timeout, each)
    own = None if timeout is None else time.monotonic() + timeout
    bound = _DEADLINE.get()
    if own is None or bound is None:
        return own if bound is None else bound
    return min(own, bound)


class LockFile:
    """One flock target, taken and let go by one thread at a time, that
    notices being deleted or replaced on disk: after every take it compares
    the descriptor's inode with the path's, and on a difference lets go,
    opens the path again (``create``: making it if gone) and takes that.
    Without ``create`` (a tool that only looks) a file gone is ``missing``:
    there is nothing to take."""

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = path
        self._create = create
        self.fd = open_lock_file(path, create)

    @classmethod
    def gone(cls, path: Path) -> LockFile:
        """A tool's lock file that is not there: nothing to take."""
        lock = cls.__new__(cls)
        lock.path, lock._create, lock.fd = path, False, -1
        return lock

    @property
    def missing(self) -> bool:
        return self.fd < 0

    def take(self, mode: int, deadline: float | None) -> None:
        """``flock(mode)`` on the file the path names now, by ``deadline``."""
        while not self.missing:
            flock_until(self.fd, mode, deadline, self.path)
            if self._current():
                return
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self._reopen()
            if self.missing:
                return

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _current(self) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        own = os.fstat(self.fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def _reopen(self) -> None:
        self.close()
        try:
            self.fd = open_lock_file(self.path, self._create)
        except FileNotFoundError:
            if self._create:
                raise
            self.fd = -1

    def close(self) -> None:
        """Also what a forked child does with its copy (never unlocking: that would unlock the parent's)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class DirLock:
    def __init__(self, path: Path, *, create: bool = True) -> None:
        """``create=False``: a tool that only looks opens an existing LOCK read-only."""
        self.path = path
        self._file = LockFile(path, create=create)
        self._thread = threading.RLock()
        self._depth = 0
        self._mode = 0
        forget_in_forked_child(self)

    def _forget_inherited(self) -> None:
        """In a forked child: close our copy of the file, whatever the parent holds."""
        self._file.close()
        self._thread, self._depth = threading.RLock(), 0

    @contextmanager
    def held(self, timeout: float | None, *, shared: bool = False) -> Iterator[None]:
        """Hold the lock (re-entrant within a thread); ``LockTimeout`` after
        ``timeout`` seconds (None: wait forever) or ``waiting_at_most``'s bound.
        A thread already holding it exclusively may nest a shared request; not
        the other way round."""
        deadline = deadline_for(timeout)
        wait = -1 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._thread.acquire(timeout=wait):
            raise LockTimeout(f"{self.path}: another thread of this process holds the lock")
        try:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            if self._depth == 0:
                self._file.take(mode, deadline)
                self._mode = mode
            elif mode == fcntl.LOCK_EX and self._mode == fcntl.LOCK_SH:
                raise RuntimeError("cannot upgrade a shared directory lock")
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._file.release()
        finally:
            self._thread.release()

    def close(self) -> None:
        self._file.close()


def open_lock_file(path: Path, create: bool) -> int:
    """A lock file's fd (read-write, created if missing; read-only with
    ``create=False``). One this user may not open says whose problem it is."""
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{exc.strerror}: a blockkv lock file this user may not open, likely "
                              "made by another user (blockkv run with sudo on this cache?); give the cache back "
                              "to its owner (chown -R)", str(path)) from None


def flock_until(fd: int, mode: int, deadline: float | None, path: Path) -> None:
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
