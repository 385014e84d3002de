"""Lock files an operator deletes or replaces ("stale lock files") are
noticed when next taken and re-taken, so two holders never both think they
hold a lock from then on (issue #43). Real files, real flocks; two open
files in one process exclude each other as two processes would."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from blockkv.errors import LockTimeout
from blockkv.local.locks import DirLock
from blockkv.local.txn_lock import TURNSTILE, TxnLock


@pytest.mark.parametrize("replace", [False, True])
def test_a_deleted_or_replaced_directory_lock_is_retaken(tmp_path: Path, replace: bool) -> None:
    path = tmp_path / "LOCK"
    old = DirLock(path)
    with old.held(1.0):
        pass
    path.unlink()
    if replace:
        path.write_text("")  # another file under the name
    new = DirLock(path)  # a process started after the deletion: the file there now
    try:
        with old.held(1.0):  # notices its file is not the path's any more, and takes the path's
            assert os.stat(path).st_ino == os.fstat(old._file.fd).st_ino
            with pytest.raises(LockTimeout):
                with new.held(0.1):
                    pass
        with new.held(1.0):
            pass
    finally:
        old.close()
        new.close()


def test_a_deleted_turnstile_is_retaken_and_the_data_lock_is_the_data_file(tmp_path: Path) -> None:
    old = TxnLock(tmp_path, timeout=1.0)
    with old.exclusive():
        pass
    (tmp_path / TURNSTILE).unlink()
    new = TxnLock(tmp_path, timeout=0.1)
    try:
        with old.exclusive():
            assert (tmp_path / TURNSTILE).exists()  # re-made by the one that noticed
            with pytest.raises(LockTimeout):
                with new.shared():
                    pass
        with new.shared():
            with pytest.raises(LockTimeout):
                with old.exclusive():  # the data lock alone keeps it out: a reader is inside
                    pass
    finally:
        old.close()
        new.close()


def test_a_waiting_writer_stops_new_readers_at_the_turnstile(tmp_path: Path) -> None:
    """Three open files on one environment behave as three processes: a reader
    is inside, a writer waits for it; a new reader must queue behind the
    writer (flock alone would let it share the first reader's lock, and a
    stream of such readers would starve the writer for ever)."""
    inside, writer, newcomer = (TxnLock(tmp_path, timeout=5.0) for _ in range(3))
    wrote = threading.Event()

    def write() -> None:
        with writer.exclusive():
            wrote.set()

    probe = os.open(tmp_path / TURNSTILE, os.O_RDONLY)
    thread = threading.Thread(target=write)
    try:
        with inside.shared():
            thread.start()
            deadline = time.monotonic() + 5.0
            while True:  # until the writer holds the turnstile
                try:
                    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(probe, fcntl.LOCK_UN)
                except BlockingIOError:
                    break
                assert time.monotonic() < deadline, "the writer never queued"
            newcomer.timeout = 0.1  # well inside the writer's first stretch (TURN_HOLD)
            with pytest.raises(LockTimeout):
                with newcomer.shared():
                    pass
            assert not wrote.is_set()
        thread.join(5.0)
        assert wrote.is_set()  # in once the reader inside left
    finally:
        thread.join(5.0)
        os.close(probe)
        for lock in (inside, writer, newcomer):
            lock.close()
