"""The transaction lock of an LMDB environment opened without LMDB's own
lock (``lmdb_env.py``): what keeps a writer from reusing a page a reader in
any process still walks, and what lets a writer in past a stream of readers.

Two flocks, in the environment's directory:

- the *data lock*, on ``data.mdb`` itself: shared for the whole life of a
  read transaction, exclusive for a write. It is the environment's own file,
  so it cannot be split from the data it guards: deleting it deletes the
  environment (every handle then reopens, ``Index.replaced``), and an
  operator's "stale lock file" is never it. A descriptor of the old file
  keeps locking the old file, which is the one its map shows.
- the *turnstile*, ``txn.lock``: a writer holds it exclusively from before
  it waits for the data lock until its transaction ends; a reader passes
  through it (takes it shared, then the data lock, then lets it go). A
  waiting writer so stops new readers at the turnstile, and waits only for
  the read transactions already inside. flock has no queue of its own: a
  stream of overlapping shared holders would starve an exclusive request
  forever. A turnstile file deleted or replaced is noticed and re-taken
  (``locks.LockFile``); until then it costs fairness, never safety.

Within a process, threads share the descriptors: the first reader takes the
data lock shared and the last lets it go, a writer waits until no thread of
the process reads, and a waiting writer stops the process's new readers too.
Every wait is bounded (``LockTimeout``) by the lock's timeout and any
``locks.waiting_at_most`` around it: a query that may not wait tries and
serves what it knows.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blockkv.errors import LockTimeout
from blockkv.local.locks import LockFile, deadline_for, flock_until, forget_in_forked_child, open_lock_file

DATA = "data.mdb"  # LMDB's data file, and the data lock
TURNSTILE = "txn.lock"


class TxnLock:
    """``env_dir``'s transaction lock. ``create=False``: a tool that only reads
    opens the existing data file read-only (FileNotFoundError without one) and
    an existing turnstile (none: it reads without one)."""

    def __init__(self, env_dir: Path, *, timeout: float, create: bool = True) -> None:
        self.path = env_dir / DATA
        self.timeout = timeout
        self._fd = open_lock_file(self.path, create)
        try:
            self._turn = LockFile(env_dir / TURNSTILE, create=create)
        except FileNotFoundError:
            self._turn = LockFile.gone(env_dir / TURNSTILE)
        self._cond = threading.Condition()
        self._readers = 0  # threads of this process inside a read transaction
        self._writing = False  # a thread of this process holds (or is taking) the lock exclusively
        self._queued = 0  # threads of this process waiting to write: new readers wait behind them
        self._passing = False  # a reader of this process is passing the turnstile
        forget_in_forked_child(self)

    @property
    def fd(self) -> int:
        """The data lock's descriptor: open on the environment's data file."""
        return self._fd

    def _forget_inherited(self) -> None:
        """In a forked child: close our copies of the files (the parent's locks stay)."""
        self._close_data()
        self._turn.close()
        self._cond, self._readers, self._writing = threading.Condition(), 0, False
        self._queued, self._passing = 0, False

    def _wait(self, deadline: float | None) -> None:
        if deadline is None:
            self._cond.wait()
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(f"{self.path}: the transaction lock is busy (another thread of this process)")
        self._cond.wait(left)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """For one read transaction: through the turnstile, then the data lock
        shared (the first reader of this process takes it, the last lets it go)."""
        deadline = deadline_for(self.timeout)
        with self._cond:
            while self._writing or self._queued or self._passing:
                self._wait(deadline)
            self._passing = True
            first = self._readers == 0
        try:
            self._turn.take(fcntl.LOCK_SH, deadline)
            try:
                if first:
                    flock_until(self._fd, fcntl.LOCK_SH, deadline, self.path)
            finally:
                self._turn.release()
        except BaseException:
            with self._cond:
                self._passing = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._passing = False
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
        """For one write transaction (or opening, or a map resize): the
        turnstile, then the data lock, exclusively; no other transaction in
        this process or any other."""
        deadline = deadline_for(self.timeout)
        with self._cond:
            self._queued += 1
            try:
                while self._writing or self._passing or self._readers:
                    self._wait(deadline)
            finally:
                self._queued -= 1
                self._cond.notify_all()
            self._writing = True
        try:
            self._turn.take(fcntl.LOCK_EX, deadline)
            try:
                flock_until(self._fd, fcntl.LOCK_EX, deadline, self.path)
                try:
                    yield
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                self._turn.release()
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _close_data(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        self._close_data()
        self._turn.close()
