"""Lock files an operator deletes or replaces ("stale lock files") are
noticed when next taken and re-taken, so two holders never both think they
hold a lock from then on (issue #43). Real files, real flocks; two open
files in one process exclude each other as two processes would."""

from __future__ import annotations

import os
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
