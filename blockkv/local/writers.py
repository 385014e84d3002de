"""Writer intents: which blocks a live writer may still reference, and whose
temp files belong to the living.

A store writes its blocks outside the directory lock (the slow part) and only
references them, under the lock, at the end. Between the two, nothing in the
index says those blocks are wanted. Each handle therefore keeps one intent
file, ``writers/<token>``, that it holds an exclusive ``flock`` on for as long
as it lives and that lists every block name a store of it is working with
(new or reused). A deleter, under the directory lock, reads every intent
file whose lock it cannot take (a live writer) and spares the names in it.
An intent file whose lock it *can* take belongs to a dead writer (the kernel
dropped the lock with the process): it is removed, and so are the temp files
named with its token.

Liveness is a kernel lock, never a clock: a clock step cannot make a live
writer look dead. The intent list is advisory (a deleter may read it a moment
before a name is appended); what makes the store safe is that the writer
re-checks every block under the directory lock before taking references and
rewrites any that is gone (docs/design.md, "Block lifetime").

What a deleter reads is bounded: each live writer's file by its size, known
(``fstat``) before the read, and all of them together by ``MAX_INTENT_BYTES``
and ``MAX_INTENT_FILES``. A live writer whose intents are not read (a file
planted or grown past the bound) may want any block, so while it lives no
unreferenced block is deleted (``Writers.complete``): sparing too much is
safe, deleting is not. A writer whose file was removed under it (an
operator's ``rm``) makes it anew at its next store, and a child forked
without exec lets go of the parent's (``locks.forget_in_forked_child``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from blockkv.fs import DIR_MODE, FILE_MODE, TMP_SUFFIX
from blockkv.local.locks import forget_in_forked_child

_TOKEN = re.compile(r"w[0-9a-f]{16}")
_NAME_LINE = re.compile(rb"[0-9a-f]{64}")
MAX_INTENT_BYTES = 8 << 20  # read of live writers' intent files per survey, all together (~130k block names)
MAX_INTENT_FILES = 256  # live writers' intent files read per survey
DEFAULT_TMP_GRACE = 3600.0  # age after which a temp file with no writer token (an older blockkv's) is stale
log = logging.getLogger("blockkv")
_warned: set[str] = set()  # live writers whose unread intents this process has warned about


def new_token() -> str:
    return "w" + secrets.token_hex(8)


def is_token(token: str) -> bool:
    return _TOKEN.fullmatch(token) is not None


def tmp_token(name: str) -> str | None:
    """The writer token inside one of our temp file names
    (``.<final name>.<token>.<random>.tmp``), or None for another shape."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return None
    parts = name[: -len(TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) == 3 and is_token(parts[1]):
        return parts[1]
    return None


class IntentFile:
    """One handle's intent file: created on first use, locked for the handle's life."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.token = new_token()
        self._fd: int | None = None
        self._names: Counter[str] = Counter()
        self._mutex = threading.Lock()
        forget_in_forked_child(self)

    @property
    def path(self) -> Path:
        return self.directory / self.token

    def _open(self) -> int:
        """Our intent file, in place. Created on first use, and anew (with the
        names we hold) if it was removed or replaced under us: a deleter reads
        only what ``writers/<token>`` holds. Create, lock, then publish under
        the final name: a deleter never sees the file unlocked (it would take it
        for a dead writer's)."""
        if self._fd is not None and not self._in_place(self._fd):
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            os.makedirs(self.directory, DIR_MODE, exist_ok=True)
            tmp = self.directory / f".{self.token}{TMP_SUFFIX}"
            _unlink(tmp)  # left by an attempt that failed part-way
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._names:
                    os.write(fd, "".join(f"{n}\n" for n in self._names).encode())
                os.rename(tmp, self.path)
            except BaseException:
                os.close(fd)
                _unlink(tmp)
                raise
            self._fd = fd
        return self._fd

    def _in_place(self, fd: int) -> bool:
        try:
            st, ours = os.stat(self.path, follow_symlinks=False), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)

    def _forget_inherited(self) -> None:
        """In a forked child: close our copy of the locked file (the parent's
        lock stays the parent's: it ends with the parent), and never speak for
        the parent's token again."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self.token, self._names, self._mutex = new_token(), Counter(), threading.Lock()

    def add(self, names: Iterable[str]) -> None:
        """Declare names a store of this handle may reference (before it looks for them)."""
        with self._mutex:
            fd = self._open()  # also before a store with no blocks: its temp files carry our token
            names = list(names)
            fresh = [n for n in dict.fromkeys(names) if self._names[n] == 0]
            for n in names:
                self._names[n] += 1
            if fresh:
                os.write(fd, "".join(f"{n}\n" for n in fresh).encode())

    def release(self, names: Iterable[str]) -> None:
        """A store is done with these names (referenced them, or gave up)."""
        with self._mutex:
            for n in names:
                self._names[n] -= 1
                if self._names[n] <= 0:
                    del self._names[n]
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
                if self._names:
                    os.write(self._fd, "".join(f"{n}\n" for n in self._names).encode())

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                _unlink(self.path)
                os.close(self._fd)
                self._fd = None


@dataclass
class Writers:
    """What a deleter learns from ``writers/``: names live writers may still
    reference, and the tokens of writers that are alive."""

    names: set[str] = field(default_factory=set)
    live: set[str] = field(default_factory=set)
    dead: list[Path] = field(default_factory=list)  # intent files of dead writers (removed by ``reap``)
    unread: list[str] = field(default_factory=list)  # live writers whose intents were not read

    @property
    def complete(self) -> bool:
        """Whether ``names`` holds every live writer's intents. If not, an
        unread writer may want any block: no unreferenced block may go."""
        return not self.unread


def survey(directory: Path) -> Writers:
    """Read every live writer's intent file, within the bounds; a file whose
    lock we can take is a dead writer's (so is an unpublished ``.<token>.tmp``
    one). Never follows a symlink; a file's size is known before it is read,
    and a live writer whose file is past the bounds is left unread (one
    warning per survey, naming the writers not warned about before), never
    allocated for."""
    out = Writers()
    budget = MAX_INTENT_BYTES
    try:
        listing = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in listing:
        unpublished = name.startswith(".") and name.endswith(TMP_SUFFIX) and is_token(name[1 : -len(TMP_SUFFIX)])
        if not (is_token(name) or unpublished):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone, or not a plain file of ours
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if not unpublished:
                    out.live.add(name)
                    size = os.fstat(fd).st_size
                    if size > budget or len(out.live) > MAX_INTENT_FILES:
                        out.unread.append(name)
                    else:
                        budget -= size
                        data = os.read(fd, size)
                        out.names.update(line.decode() for line in data.split(b"\n") if _NAME_LINE.fullmatch(line))
            else:
                out.dead.append(path)
        except OSError:
            if not unpublished:
                out.live.add(name)  # cannot tell: treat as alive, its intents unknown (that only delays deletions)
                out.unread.append(name)
        finally:
            os.close(fd)
    _warn_unread(out.unread)
    return out


def _warn_unread(tokens: list[str]) -> None:
    """One warning for the live writers a survey could not read that this process has not warned about."""
    new = [t for t in tokens if t not in _warned]
    if new:
        _warned.update(new)
        log.warning("blockkv: intent files of %d live writer(s) not read (%s%s: over %d files or %d bytes, or "
                    "unreadable): no unreferenced block is deleted while they live", len(new), ", ".join(new[:3]),
                    "..." if len(new) > 3 else "", MAX_INTENT_FILES, MAX_INTENT_BYTES)


def reap(writers: Writers) -> None:
    """Remove the intent files of dead writers (the caller holds the directory lock)."""
    for path in writers.dead:
        _unlink(path)


def stale_temp_files(paths: Iterable[str], writers: Writers, cutoff: float) -> list[Path]:
    """Our temp files whose writer is dead. One that names a live writer is
    never stale, whatever the clock says; one without a writer token (written
    by an older blockkv) is stale once its mtime is before ``cutoff``."""
    stale = []
    for p in paths:
        path = Path(p)
        token = tmp_token(path.name)
        if token is not None:
            if token not in writers.live:
                stale.append(path)
            continue
        try:
            if path.stat(follow_symlinks=False).st_mtime < cutoff:
                stale.append(path)
        except FileNotFoundError:
            continue
    return stale


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
