"""Defaults taken from the platform (issue #31): the cache root by the
platform's convention, with the old default still found on macOS; worker
threads from the machine's cores, bounded; a lock file another user owns is
a clear error."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockkv.local.directory import ROOT_MARKER, default_root
from blockkv.local.executors import _MAX_CORE_THREADS, core_threads
from blockkv.local.locks import DirLock
from blockkv.local.txn_lock import TxnLock

NOBODY = 65534  # an unprivileged uid that owns nothing here


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path


def test_the_default_root_elsewhere_is_the_xdg_cache(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_root("linux") == home / ".cache" / "blockkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg"))
    assert default_root("linux") == home / "xdg" / "blockkv"


def test_the_default_root_on_macos_is_library_caches(home: Path) -> None:
    assert default_root("darwin") == home / "Library" / "Caches" / "blockkv"


def test_on_macos_a_cache_at_the_old_default_is_still_found(home: Path) -> None:
    old = home / ".cache" / "blockkv"
    old.mkdir(parents=True)
    (old / ROOT_MARKER).write_text("")
    assert default_root("darwin") == old
    (home / "Library" / "Caches" / "blockkv").mkdir(parents=True)  # once the new place exists, it wins
    assert default_root("darwin") == home / "Library" / "Caches" / "blockkv"


def test_core_threads_follow_the_machine_within_bounds() -> None:
    n = core_threads()
    assert 2 <= n <= _MAX_CORE_THREADS
    assert n == max(2, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2,
                           _MAX_CORE_THREADS))


@contextlib.contextmanager
def _as_another_user() -> Iterator[None]:
    """This process as user ``nobody`` while inside (root's file access is
    not checked, so as root the test drops to another effective user and back;
    an ordinary user is already not the lock file's owner's match)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("lock", [DirLock, TxnLock])
def test_a_lock_file_this_user_may_not_open_is_a_clear_error(lock: type) -> None:
    # a directory every user may enter (pytest's own tmp_path is root's alone)
    directory = Path(tempfile.mkdtemp(prefix="blockkv-lock-"))
    try:
        directory.chmod(0o755)
        path = directory / ("data.mdb" if lock is TxnLock else "LOCK")  # the transaction lock is on the data file
        path.write_text("")
        path.chmod(0)
        kwargs = {"timeout": 1.0} if lock is TxnLock else {}
        with _as_another_user(), pytest.raises(PermissionError, match="another user"):
            lock(directory if lock is TxnLock else path, **kwargs)
    finally:
        shutil.rmtree(directory)
