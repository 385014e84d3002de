"""A stopped process costs nobody else more than a moment (issue #43).

A process stopped (SIGSTOP: Ctrl-Z, a debugger, a suspended laptop) inside
an index transaction holds the transaction lock. Queries in other processes
answer from what their handle knows without waiting for it; a store waits
its ``lock_timeout`` at most and is "not stored"; a new open is bounded; once
the process is continued, stores land again and nothing acknowledged is
lost. Also: a stream of processes scanning the index (``ls``/``stats``)
cannot starve a writer, and a transaction lock file deleted under churn is
re-taken, never split.

Real processes, real SIGSTOP/SIGCONT, real caches from a tiny model's
forward passes, compared bit for bit. Every wait is bounded generously: the
bounds say "well before the 10 s lock timeout", never a rate. CI also runs
this file on py-lmdb built with POSIX semaphores (.ci/run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.stateful import live_bits
from blockkv.testing.stopped import HOLDER_SEEDS, continued, ended, holder_caches, stopped_in_txn

WAIT = 120  # seconds any child may take: far beyond a healthy run, short of a hung CI job
QUICK = 1.0  # a query behind a stopped process: well under the 10 s the lock made it wait before
LOCK_TIMEOUT = 2.0
IDENT = dict(model_id="m", config_fingerprint="fp-stopped", tokenizer_hash="t", max_bytes=1 << 30,
             block_tokens=16, lock_timeout=LOCK_TIMEOUT)

_COMMON = textwrap.dedent(f"""
    import sys, time
    from blockkv import BlockStore
    IDENT = {IDENT!r}
""")

# A new open while the holder is stopped: how long it took, and whether it opened.
_NEWCOMER = _COMMON + textwrap.dedent("""
    from blockkv.errors import LockTimeout
    t0 = time.monotonic()
    try:
        BlockStore(sys.argv[1], **dict(IDENT, lock_timeout=10.0)).close()
        print("opened", time.monotonic() - t0, flush=True)
    except LockTimeout:
        print("busy", time.monotonic() - t0, flush=True)
""")


caches_of = holder_caches


def restored_exactly(store: BlockStore, seed: int) -> bool:
    tokens, expected = caches_of(seed)
    match = store.find_exact(tokens)
    loaded = store.restore(match.entry) if match is not None else None
    return loaded is not None and all(live_bits(a) == live_bits(b) for a, b in zip(loaded.caches, expected))


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True)


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("mode", ["write", "read"])
def test_a_process_stopped_inside_a_transaction_delays_no_query(tmp_path: Path, mode: str) -> None:
    acked = [10]
    holder = None
    with BlockStore(tmp_path, **IDENT) as store:
        assert store.store(*caches_of(10))
        try:
            holder = stopped_in_txn(tmp_path, mode, IDENT)
            for _ in range(3):  # the first query may try the lock briefly; the later ones do not wait
                assert timed(lambda: restored_exactly(store, 10)) < (True, QUICK)
            if mode == "read":  # readers share the lock: this handle even sees the holder's entry
                assert restored_exactly(store, 1)
            # a store behind it waits its lock_timeout at most, then is "not stored";
            # a query meanwhile still answers at once (it never queues behind the writer)
            result: list[bool] = []
            writer = threading.Thread(target=lambda: result.append(store.store(*caches_of(11))))
            writer.start()
            time.sleep(0.2)
            assert timed(lambda: restored_exactly(store, 10)) < (True, QUICK)
            writer.join(LOCK_TIMEOUT + WAIT)
            assert result == [False]
            newcomer = subprocess.run([sys.executable, "-c", _NEWCOMER, str(tmp_path)], capture_output=True,
                                      text=True, timeout=WAIT)
            verdict, seconds = newcomer.stdout.split()
            assert float(seconds) < 5.0, newcomer.stderr[-2000:]  # bounded: it waited 10 s, then raised, before
            if mode == "read":
                assert verdict == "opened"  # opening only reads: a stopped reader keeps nobody out
            assert continued(holder, WAIT) == "stored"
            acked += list(HOLDER_SEEDS)
            assert store.store(*caches_of(12))  # stores resume once it is continued
            acked.append(12)
        finally:
            ended(holder)
    with BlockStore(tmp_path, **IDENT) as fresh:
        assert [seed for seed in acked if not restored_exactly(fresh, seed)] == []


def test_a_paged_catalog_reads_its_labels_past_a_stopped_writer(tmp_path: Path) -> None:
    """The catalog holds no tokens once loaded (issue #45): a lookup reads the
    trie's edge labels, and the tokens and block names of what it hands out,
    from the entries' header files, never the index: it answers while another
    process is stopped inside a write transaction, with this process's own
    store queued behind that (which stops this process's new index readers)."""
    shared = random_tokens(24, seed=30)
    prompts = [shared + random_tokens(16, seed=seed) for seed in (31, 32, 33)]
    with BlockStore(tmp_path, **IDENT) as first:
        for tokens in prompts:
            assert first.store(tokens, prefill(tiny_model("llama"), tokens)[0])
    holder = None
    with BlockStore(tmp_path, **IDENT) as store:  # loaded: no label read yet, none kept
        headers = store._catalog._pages.headers
        assert headers._cache == {}
        try:
            holder = stopped_in_txn(tmp_path, "write", IDENT)
            result: list[bool] = []
            writer = threading.Thread(target=lambda: result.append(store.store(*caches_of(11))))
            writer.start()
            time.sleep(0.2)
            for tokens in prompts:
                match, seconds = timed(lambda tokens=tokens: store.find(tokens + [7]))
                assert seconds < QUICK and match is not None and match.prefix_len == len(tokens)
                assert match.entry.tokens == tuple(tokens) and len(match.entry.blocks) > 0
                loaded = store.restore(match.entry, match.prefix_len)
                expected = prefill(tiny_model("llama"), tokens)[0]
                assert loaded is not None and all(live_bits(a) == live_bits(b) for a, b in zip(loaded.caches, expected))
            assert len(headers._cache) > 0  # the labels came from the headers
            writer.join(LOCK_TIMEOUT + WAIT)
            assert result == [False]
            assert continued(holder, WAIT) == "stored"
        finally:
            ended(holder)


# -- a stream of scanning readers cannot starve a writer ------------------------------------------------

SCANNERS = 8
SCANNER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from blockkv.local.reader import read_directory
    directory, stop = Path(sys.argv[1]), Path(sys.argv[2])
    scans = 0
    while not stop.exists():  # what `blockkv ls` and `stats` read, again and again
        assert read_directory(directory).index_used
        scans += 1
        if scans == 1:
            print("scanning", flush=True)
    print(scans, flush=True)
""")


def test_a_stream_of_scanning_readers_starves_no_writer(tmp_path: Path) -> None:
    """Eight processes loop the ``ls``/``stats`` scan of the index; every store
    of a ninth still lands (the turnstile stops new readers while a writer
    waits; each scan reads in short transactions)."""
    model = tiny_model("llama")
    entries, stores = 240, 10
    with BlockStore(tmp_path, **dict(IDENT, lock_timeout=10.0)) as store:
        for seed in range(entries):  # shared prefixes keep the root small and its stores quick
            tokens = random_tokens(16, seed=0) + random_tokens(8, seed=1000 + seed)
            assert store.store(tokens, prefill(model, tokens)[0])
        stop = tmp_path / "stop"
        scanners = [spawn(SCANNER, store.directory, stop) for _ in range(SCANNERS)]
        try:
            assert [line(p) for p in scanners] == ["scanning"] * SCANNERS
            landed = [store.store(*caches_of(5000 + i)) for i in range(stores)]
            stop.touch()
            scans = [int(line(p)) for p in scanners]
        finally:
            for p in scanners:
                p.kill()
                p.wait()
        assert landed == [True] * stores
        assert min(scans) >= 1
    with BlockStore(tmp_path, **IDENT) as fresh:
        assert all(restored_exactly(fresh, 5000 + i) for i in range(stores))


# -- a deleted lock file is re-taken, never split ---------------------------------------------------------


def test_deleting_the_lock_file_under_churn_tears_no_read(tmp_path: Path) -> None:
    """The operator's "stale lock file": ``index/txn.lock`` deleted again and
    again while a writer rewrites every row and processes scan them (some
    opened after a deletion). Every scan still sees one committed state."""
    from test_lock_death import SCANNER_SCRIPT, WRITER_SCRIPT

    env_dir, gens = tmp_path / "index", "400"
    writer = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(env_dir), gens])
    scanners: list[subprocess.Popen[str]] = []
    try:
        lock = env_dir / "txn.lock"
        for _ in range(3):
            deadline = time.monotonic() + WAIT
            while not lock.exists():
                assert time.monotonic() < deadline and writer.poll() is None, "the writer never took the lock"
                time.sleep(0.005)
            lock.unlink()
            scanners.append(subprocess.Popen([sys.executable, "-c", SCANNER_SCRIPT, str(env_dir), gens],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=WAIT) for p in scanners]
        assert writer.wait(WAIT) == 0
    finally:
        for p in (writer, *scanners):
            p.kill()
            p.wait()
    assert [out.startswith("mixed 0 of ") for out, _ in outs] == [True] * 3, outs


# -- a writer waiting on a stopped reader keeps the other readers out only for a moment --------------

_STOPPED_READER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from blockkv.local.txn_lock import TxnLock
    lock = TxnLock(Path(sys.argv[1]), timeout=60.0)
    with lock.shared():
        print("reading", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
""")

_WAITING_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from blockkv.errors import LockTimeout
    from blockkv.local.txn_lock import TxnLock
    lock = TxnLock(Path(sys.argv[1]), timeout=60.0)
    print("waiting", flush=True)
    with lock.exclusive():
        print("wrote", flush=True)
""")


def test_readers_get_past_a_writer_that_waits_on_a_stopped_reader(tmp_path: Path) -> None:
    """The turnstile stops new readers while a writer waits, but a writer
    whose wait outlasts any read transaction (a stopped reader is inside)
    steps aside between stretches: readers in other processes still get in;
    once the reader is continued the writer writes."""
    from blockkv.local.txn_lock import TxnLock

    reader = spawn(_STOPPED_READER, tmp_path)
    writer = None
    lock = TxnLock(tmp_path, timeout=5.0)
    try:
        assert line(reader) == "reading"
        _, status = os.waitpid(reader.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        writer = spawn(_WAITING_WRITER, tmp_path)
        assert line(writer) == "waiting"
        for _ in range(5):
            time.sleep(0.2)  # somewhere in the writer's stretches and pauses
            with lock.shared():
                pass  # got in (within its 5 s: the writer waits up to 60 s)
        reader.send_signal(signal.SIGCONT)
        assert reader.wait(WAIT) == 0
        assert line(writer) == "wrote"
    finally:
        lock.close()
        for p in (reader, writer):
            if p is not None:
                p.kill()
                p.wait()
