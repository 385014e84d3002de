"""One LMDB environment per process and file, shared by every index handle.

LMDB forbids opening one environment twice in a process, so handles share it
through a registry keyed by path and inode. The environment is opened without
LMDB's own lock (``lock=False``): on macOS its cross-process writer lock is a
POSIX semaphore, which a SIGKILLed writer never releases (every other process
then hangs on its next write). Every transaction instead holds the
environment's ``TxnLock`` (flocks, released by the kernel when their holder
dies; txn_lock.py): shared for the life of a read, exclusive for a write and
for a map resize (py-lmdb forbids resizing while another thread is inside a
transaction). Opening an existing environment only reads, so it holds the
lock shared: a stopped reader never keeps a new handle out; a new one is
initialised by its first opener, holding it exclusively. Nothing here knows
the index's tables (index.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from blockkv.local.txn_lock import DATA, TxnLock

# liblmdb errors that prove an environment broken (not a transient failure):
# only these move it aside to be rebuilt
BROKEN_INDEX = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.IncompatibleError,
                lmdb.PageNotFoundError, lmdb.BadRslotError)
R = TypeVar("R")
TXN_TIMEOUT = 10.0  # the longest a transaction waits for another's: only a stopped process holds it that long


def boot_id(platform: str = sys.platform) -> str:
    """Changes on every OS boot: Linux's ``boot_id``, macOS's
    ``kern.bootsessionuuid``; '' where unknown (then transactions are synced)."""
    if platform == "darwin":
        return _boot_session_uuid()
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@functools.cache
def _boot_session_uuid() -> str:
    """``sysctlbyname("kern.bootsessionuuid")`` (a UUID string, new each boot); '' if it fails."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(64)
        size = ctypes.c_size_t(len(buf))
        if libc.sysctlbyname(b"kern.bootsessionuuid", buf, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
            return ""
    except (OSError, AttributeError):  # no libc, or no sysctlbyname in it (not macOS)
        return ""
    return buf.value.decode("ascii", "replace").strip()


@dataclass
class SharedEnv:
    """An open environment and the handles using it; its transactions grow
    the map when it is full and adopt a size another process set."""

    env: lmdb.Environment
    key: tuple[int, int]  # (st_dev, st_ino) of data.mdb when opened
    txns: TxnLock
    users: int = 1
    _opening: threading.Lock = field(default_factory=threading.Lock)  # one thread opens tables at a time

    def open_dbs(self, names: tuple[bytes, ...]) -> list[Any]:
        """The named tables. When they all exist (a table is a key of the main
        database) they are opened under the lock shared, in a write
        transaction that changes nothing and so writes nothing at its commit
        (py-lmdb drops the handles a read transaction opened); else created
        (a write, which may need the map to grow too)."""
        with self._opening:
            with self.txns.shared(), self.env.begin(write=True) as txn:
                if all(txn.get(name) is not None for name in names):
                    return [self.env.open_db(name, txn=txn, create=False) for name in names]
            return [self._create_db(name) for name in names]

    def _create_db(self, name: bytes) -> Any:
        while True:
            try:
                with self.txns.exclusive():
                    return self.env.open_db(name)
            except lmdb.MapFullError:
                self._grow()

    def write(self, fn: Callable[[lmdb.Transaction], R]) -> R:
        """Run ``fn`` in a write transaction; grow the map when it is full."""
        while True:
            try:
                with self.txns.exclusive(), self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_size()

    def read(self, fn: Callable[[lmdb.Transaction], R], *, buffers: bool = False) -> R:
        """Run ``fn`` in a read transaction (``buffers``: values are views into
        the map, valid only inside ``fn``)."""
        while True:
            try:
                with self.txns.shared(), self.env.begin(buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_size()

    def sync(self) -> None:
        """Every committed transaction durable (fdatasync of the data file), even
        in an environment opened without sync."""
        with self.txns.shared():
            self.env.sync(True)

    def _grow(self) -> None:
        """Double the map, with no transaction of this process open (py-lmdb's rule)."""
        with self.txns.exclusive():
            self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _adopt_size(self) -> None:
        """Another process grew the map: adopt its size, again with no transaction open."""
        with self.txns.exclusive():
            self.env.set_mapsize(0)


# LMDB forbids opening one environment twice in a process; handles share one.
_ENVS: dict[tuple[str, int, int], SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def env_key(path: Path) -> tuple[int, int]:
    st = os.stat(path / "data.mdb")
    return (st.st_dev, st.st_ino)


def open_env(path: Path, map_size: int, *, max_dbs: int, sync: bool) -> SharedEnv:
    resolved = str(path.resolve())
    with _ENVS_LOCK:
        try:
            key = env_key(path)
        except FileNotFoundError:
            key = None
        if key is not None and (resolved, *key) in _ENVS:
            shared = _ENVS[(resolved, *key)]
            shared.users += 1
            return shared
        # first: a stale environment's turnstile is re-taken below, in this directory
        # even when the whole of it was deleted (a damaged index thrown away)
        path.mkdir(mode=0o700, exist_ok=True)
        # liblmdb refuses a second environment on one lock file: one whose data
        # file was replaced in place is dead. Close it once no transaction is
        # inside it; its handles get an error and reopen (``Index.replaced``).
        for stale in [v for k, v in _ENVS.items() if k[0] == resolved]:
            with stale.txns.exclusive():
                stale.env.close()
            for k in [k for k, v in _ENVS.items() if v is stale]:
                del _ENVS[k]
        txns = TxnLock(path, timeout=TXN_TIMEOUT)
        try:
            env, key = _open_locked(path, txns, map_size, max_dbs, sync)
        except BaseException:
            txns.close()
            raise
        shared = _ENVS[(resolved, *key)] = SharedEnv(env, key, txns)
        return shared


def _open_locked(path: Path, txns: TxnLock, map_size: int, max_dbs: int,
                 sync: bool) -> tuple[lmdb.Environment, tuple[int, int]]:
    """liblmdb's open of ``path``: shared when the data file already holds an
    environment (open only reads its meta pages), exclusive when this opener
    must write them. The file opened is the one the data lock locks."""
    new = os.fstat(txns.fd).st_size == 0
    with txns.exclusive() if new else txns.shared():
        env = lmdb.open(str(path), map_size=map_size, max_dbs=max_dbs, lock=False,
                        sync=sync, metasync=sync, readahead=False, mode=0o600)
        st = os.fstat(txns.fd)
        key = env_key(path)
    if key != (st.st_dev, st.st_ino):  # replaced between our open and liblmdb's
        env.close()
        raise lmdb.Error(f"{path / DATA} was replaced while it was being opened")
    return env, key


def release_env(shared: SharedEnv) -> None:
    """Close the environment once its last handle lets go."""
    with _ENVS_LOCK:
        shared.users -= 1
        if shared.users:
            return
        for k, v in list(_ENVS.items()):
            if v is shared:
                del _ENVS[k]
        shared.env.close()  # a no-op if it was closed as stale
        shared.txns.close()
