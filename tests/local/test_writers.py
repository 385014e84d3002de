"""Writer intents and the directory lock, with real processes holding real flocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from blockkv.errors import LockTimeout
from blockkv.fs import tmp_name
from blockkv.local import writers
from blockkv.local.locks import DirLock

NAME_A, NAME_B = "a" * 64, "b" * 64

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from blockkv.local.writers import IntentFile
    intents = IntentFile(Path(sys.argv[1]))
    intents.add([sys.argv[2]])
    print(intents.token, flush=True)
    time.sleep(60)
    """
)


def _holder(directory: Path, name: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), name],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_live_writer_is_seen_and_a_killed_one_is_reaped(tmp_path: Path) -> None:
    d = tmp_path / "writers"
    proc, token = _holder(d, NAME_A)
    try:
        survey = writers.survey(d)
        assert token in survey.live and NAME_A in survey.names and not survey.dead
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    survey = writers.survey(d)  # the kernel dropped its lock with the process
    assert not survey.live and not survey.names and survey.dead == [d / token]
    writers.reap(survey)
    assert os.listdir(d) == []


def test_own_intents_are_live_to_this_process_and_released_names_go(tmp_path: Path) -> None:
    d = tmp_path / "writers"
    intents = writers.IntentFile(d)
    intents.add([NAME_A, NAME_B])
    intents.add([NAME_A])  # a second store of the same handle needs A too
    assert writers.survey(d).names == {NAME_A, NAME_B}
    intents.release([NAME_A, NAME_B])
    assert writers.survey(d).names == {NAME_A}
    intents.release([NAME_A])
    assert writers.survey(d).names == set() and intents.token in writers.survey(d).live
    intents.close()
    assert os.listdir(d) == []


def test_temp_files_are_stale_by_liveness_not_by_clock(tmp_path: Path) -> None:
    d = tmp_path / "writers"
    intents = writers.IntentFile(d)
    intents.add([])
    live_tmp = tmp_name(tmp_path / NAME_A, intents.token)
    dead_tmp = tmp_name(tmp_path / NAME_B, writers.new_token())
    legacy_old, legacy_new = tmp_path / f".{NAME_A}.0123456789ab.tmp", tmp_path / f".{NAME_B}.ba9876543210.tmp"
    for p in (live_tmp, dead_tmp, legacy_old, legacy_new):
        p.write_bytes(b"x")
    os.utime(legacy_old, (1, 1))
    os.utime(live_tmp, (1, 1))  # however old it looks, its writer is alive
    survey = writers.survey(d)
    far_future = time.time() + 10 * 86400  # a clock days ahead
    assert set(writers.stale_temp_files(map(str, (live_tmp, dead_tmp, legacy_old)), survey, time.time() - 3600)) \
        == {dead_tmp, legacy_old}
    assert live_tmp not in writers.stale_temp_files([str(live_tmp)], survey, far_future)
    assert writers.tmp_token(live_tmp.name) == intents.token and writers.tmp_token(legacy_new.name) is None
    intents.close()


def test_planted_intent_files_are_not_followed(tmp_path: Path) -> None:
    d = tmp_path / "writers"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text(NAME_A + "\n")
    (d / writers.new_token()).symlink_to(victim)
    os.mkfifo(d / writers.new_token())
    survey = writers.survey(d)  # must not hang on the FIFO nor trust the link
    assert not survey.names and not survey.live
    writers.reap(survey)
    assert victim.exists()


_LOCKER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
    """
)


def test_lock_waits_are_bounded_and_a_dead_holder_frees_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "LOCK"
    proc = subprocess.Popen([sys.executable, "-c", _LOCKER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    lock = DirLock(path)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout):
            with lock.held(0.3):
                pass
        assert time.monotonic() - t0 < 5
        with pytest.raises(TimeoutError):  # LockTimeout is a TimeoutError too
            with lock.held(0.0, shared=True):
                pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with lock.held(5.0):
            with lock.held(5.0, shared=True):  # nests inside an exclusive hold
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lock.close()
