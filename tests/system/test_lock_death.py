"""No lock blockkv or LMDB takes outlives its process (issue #31).

LMDB is opened without its own lock; every transaction holds the
environment's flocks (``TxnLock``), which the kernel releases when its holder
dies. The py-lmdb that macOS uses selects POSIX semaphores for LMDB's own
writer lock, and a SIGKILLed holder never releases one: CI builds py-lmdb
that way on Linux (``CFLAGS=-DMDB_USE_POSIX_SEM``, .ci/run) and runs this
file there, where the code before this lock hung the survivor's store.

Real processes, a real kill -9 inside a real write transaction, real caches
from a tiny model. Every wait on a child is bounded, so a wedge fails the
test instead of hanging it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from blockkv.errors import LockTimeout
from blockkv.local.txn_lock import TxnLock

WAIT = 120  # seconds any child may take: far beyond a healthy run, short of a hung CI job

_COMMON = textwrap.dedent("""
    import sys, time
    from blockkv import BlockStore
    from blockkv.testing.models import prefill, random_tokens, tiny_model
    IDENT = dict(model_id="m", config_fingerprint="fp-death", tokenizer_hash="t", max_bytes=1 << 30,
                 block_tokens=16, lock_timeout=2.0)

    def store(s, seed):
        tokens = random_tokens(40, seed=seed)
        return s.store(tokens, prefill(tiny_model("llama"), tokens)[0])
""")

# Inside a write transaction of the index, holding the directory lock (as a
# store's index write does), when the parent kills it.
_VICTIM = _COMMON + textwrap.dedent("""
    s = BlockStore(sys.argv[1], **IDENT)
    assert store(s, 1)

    def hang(txn):
        txn.put(b"victim", b"was here")
        print("in-txn", flush=True)
        time.sleep(600)

    with s._keeper.locked(2.0, 0.0):
        s._keeper.index._env.write(hang)
""")

# Has the root open before the kill; stores once told to.
_SURVIVOR = _COMMON + textwrap.dedent("""
    s = BlockStore(sys.argv[1], **IDENT)
    print("open", flush=True)
    sys.stdin.readline()
    print("stored" if store(s, 2) else "not stored", flush=True)
    s.close()
""")

# Opened after the kill: opens, stores, and finds both its entry and the survivor's.
_NEWCOMER = _COMMON + textwrap.dedent("""
    s = BlockStore(sys.argv[1], **IDENT)
    ok = store(s, 3)
    found = [s.find_exact(random_tokens(40, seed=seed)) is not None for seed in (1, 2, 3)]
    print("stored" if ok else "not stored", found, flush=True)
    s.close()
""")


def spawn(script: str, root: Path, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True, **kw)


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def test_a_writer_killed_inside_an_index_write_wedges_nothing(tmp_path: Path) -> None:
    survivor = spawn(_SURVIVOR, tmp_path, stdin=subprocess.PIPE)
    victim = None
    try:
        assert line(survivor) == "open"  # before the victim holds the transaction lock (an open waits for it)
        victim = spawn(_VICTIM, tmp_path)
        assert line(victim) == "in-txn"
        victim.send_signal(signal.SIGKILL)
        victim.wait(WAIT)
        assert survivor.stdin is not None
        survivor.stdin.write("go\n")
        survivor.stdin.flush()
        out, _ = survivor.communicate(timeout=WAIT)  # its store hung here on LMDB's semaphore before
        assert out.strip() == "stored"
        newcomer = subprocess.run([sys.executable, "-c", _NEWCOMER, str(tmp_path)], capture_output=True,
                                  text=True, timeout=WAIT)
        assert newcomer.stdout.strip() == "stored [True, True, True]", newcomer.stderr[-2000:]
    finally:
        for proc in (victim, survivor):
            if proc is not None:
                proc.kill()
                proc.wait()


_READER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from blockkv.local.txn_lock import TxnLock
    lock = TxnLock(Path(sys.argv[1]), timeout=5.0)
    with lock.shared():
        print("reading", flush=True)
        time.sleep(600)
""")


def test_a_reader_in_another_process_keeps_writers_out_until_it_dies(tmp_path: Path) -> None:
    """Without LMDB's reader table, the shared flock held for a read
    transaction's life is all that stops a writer reusing its pages."""
    path = tmp_path  # the environment's directory
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(path)], stdout=subprocess.PIPE, text=True)
    lock = TxnLock(path, timeout=0.2)
    try:
        assert line(reader) == "reading"
        with lock.shared():  # readers share it
            pass
        with pytest.raises(LockTimeout):
            with lock.exclusive():
                pass
        reader.send_signal(signal.SIGKILL)
        reader.wait(WAIT)
        lock.timeout = WAIT
        with lock.exclusive():  # the kernel let the dead reader's lock go
            pass
    finally:
        reader.kill()
        reader.wait()
        lock.close()


_ROWS = 64
WRITER_SCRIPT = textwrap.dedent(f"""
    import sys
    from pathlib import Path
    from blockkv.local.lmdb_env import open_env, release_env
    env = open_env(Path(sys.argv[1]), 1 << 24, max_dbs=1, sync=False)
    for gen in range(int(sys.argv[2])):
        def rewrite(txn, gen=gen):
            for k in range({_ROWS}):  # every row rewritten: the old pages are free for the next writer
                txn.put(b"%04d" % k, (b"%08d" % gen) * 512)
        env.write(rewrite)
    release_env(env)
""")

SCANNER_SCRIPT = textwrap.dedent(f"""
    import sys
    from pathlib import Path
    from blockkv.local.lmdb_env import open_env, release_env
    env = open_env(Path(sys.argv[1]), 1 << 24, max_dbs=1, sync=False)
    last = b"%08d" % (int(sys.argv[2]) - 1)
    mixed = scans = 0
    gens = set()
    while gens != {{last}}:  # until the writer's last generation: every one of its writes overlapped a scan
        rows = env.read(lambda txn: [v for _, v in txn.cursor()])
        if rows:
            scans += 1
            gens = {{v[:8] for v in rows}}
            if len(rows) != {_ROWS} or len(gens) != 1 or any(v != v[:8] * 512 for v in rows):
                mixed += 1
    release_env(env)
    print("mixed", mixed, "of", scans, flush=True)
""")


def test_readers_in_another_process_see_one_committed_state_while_a_writer_rewrites(tmp_path: Path) -> None:
    """LMDB without its lock keeps no reader table: only the shared lock,
    held for the read transaction's life, keeps a writer from reusing the
    pages a reader in another process walks. Every scan must see all rows of
    one generation, whole."""
    env_dir = tmp_path / "index"
    writer = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(env_dir), "500"])
    try:
        scanner = subprocess.run([sys.executable, "-c", SCANNER_SCRIPT, str(env_dir), "500"], capture_output=True,
                                 text=True, timeout=WAIT)
        assert writer.wait(WAIT) == 0
    finally:
        writer.kill()
        writer.wait()
    assert scanner.stdout.startswith("mixed 0 of "), scanner.stdout + scanner.stderr[-2000:]
