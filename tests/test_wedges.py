"""Nothing read is unbounded, and nothing wedges (issue #22, cases 6 and 9;
the read-only commands' half of case 9 is in test_cli.py).

- Live writers' intent files are read with a bound known before the read,
  and a bounded number of them; one that is not read makes deleters spare
  every unreferenced block (sparing too much is safe, deleting is not).
- A writer whose intent file was removed recreates it: its stores go on.
- A ``fork()`` without exec inside a store leaves the child holding neither
  the directory lock nor the parent's intent file; kill -9 of the parent
  frees both.

Real processes where a lock's owner matters (a helper holding flocks, a
forked child), real caches from a tiny model.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore
from blockkv.fs import FileLayer
from blockkv.local import writers
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp-wedges", tokenizer_hash="t", max_bytes=1 << 30)
B = 16


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


def open_store(root: Path, **kw: Any) -> BlockStore:
    return BlockStore(root, **{**IDENT, "block_tokens": B, **kw})


def stored(s: BlockStore, model: Any, seed: int, n: int = 40) -> list[int]:
    tokens = random_tokens(n, seed=seed)
    assert s.store(tokens, prefill(model, tokens)[0])
    return tokens


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- case 6: intent files read with a bound ----------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fds = []
    for path in sys.argv[1:]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    print("held", flush=True)
    time.sleep(600)
""")


def hold(paths: list[Path]) -> subprocess.Popen[str]:
    """A live 'writer': another process holding an exclusive flock on each path."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, *map(str, paths)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def unreferenced_blocks(tmp_path: Path, model: Any) -> tuple[BlockStore, int]:
    """A store (``gc_grace=0``) holding one removed entry's blocks, which gc may delete."""
    s = open_store(tmp_path, gc_grace=0.0)
    tokens = stored(s, model, 7)
    s.remove(s.find_exact(tokens).entry)
    return s, sum(1 for p in (s.directory / "blobs").rglob("*") if p.is_file())


def test_planted_giant_intent_files_are_not_read_and_spare_every_block(
        tmp_path: Path, model: Any, caplog: pytest.LogCaptureFixture) -> None:
    s, blocks = unreferenced_blocks(tmp_path, model)
    planted = [s.directory / "writers" / f"w{i:016x}" for i in range(12)]
    for p in planted:
        with open(p, "wb") as f:
            f.truncate(64 << 20)  # 64 MiB each (sparse: no disk spent)
    holder = hold(planted)
    try:
        with caplog.at_level(logging.WARNING, logger="blockkv"):
            tracemalloc.start()
            try:
                assert s.gc() == 0 and s.gc() == 0
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        assert peak < 64 << 20, f"gc allocated {peak} bytes: a planted intent file was read"
        assert sum(1 for p in (s.directory / "blobs").rglob("*") if p.is_file()) == blocks  # spared
        report = s.check()  # the unread writers are named, and no block is called an orphan
        assert sorted(report.unreadable) == sorted(f"writers/{p.name}" for p in planted)
        assert report.orphan_blocks == [] and not report.clean
        assert len([w for w in warnings_of(caplog) if "intent" in w]) == 1
    finally:
        holder.kill()
        holder.wait()
    assert s.gc() == blocks  # the planted files' holder is dead: their files go, and the blocks with them
    assert not any(p.exists() for p in planted)
    s.close()


def test_too_many_live_intent_files_spare_every_block(tmp_path: Path, model: Any) -> None:
    s, blocks = unreferenced_blocks(tmp_path, model)
    holder = hold([s.directory / "writers" / f"w{i:016x}" for i in range(writers.MAX_INTENT_FILES + 1)])
    try:
        assert s.gc() == 0
        assert sum(1 for p in (s.directory / "blobs").rglob("*") if p.is_file()) == blocks
    finally:
        holder.kill()
        holder.wait()
    assert s.gc() == blocks
    s.close()


# -- case 9: a removed intent file, a fork inside a store --------------------------------------------


class DuringStore(FileLayer):
    """Runs ``during()`` while a store of this handle has written its blocks and
    not yet taken the lock: where another process's gc or open lands."""

    def __init__(self) -> None:
        self.during: Any = None

    def crash_point(self, name: str) -> None:
        if name == "store:blocks-written" and self.during is not None:
            self.during()


def test_a_writer_whose_intent_file_was_removed_recreates_it(tmp_path: Path, model: Any) -> None:
    layer = DuringStore()
    with open_store(tmp_path, fs=layer) as s, open_store(tmp_path, gc_grace=0.0) as sweeper:
        first = stored(s, model, 1)
        intent = s.directory / "writers" / s._intents.token
        intent.unlink()  # an operator's rm, or a cleanup script
        layer.during = sweeper.gc  # another handle's gc in the middle of every store
        later = [stored(s, model, seed) for seed in (2, 3, 4)]
        assert intent.exists()
        for tokens in [first, *later]:
            match = s.find_exact(tokens)
            assert match is not None and s.restore(match.entry) is not None


_FORKER = textwrap.dedent("""
    import os, sys, time
    from blockkv import BlockStore
    from blockkv.fs import FileLayer
    from blockkv.testing.models import prefill, random_tokens, tiny_model

    class ForkInsideTheLock(FileLayer):
        '''Right after the header's rename, with the directory lock held: fork (no exec),
        say who is who, and stay there until killed.'''
        token = ""
        def fsync_dir(self, path):
            super().fsync_dir(path)
            if path.parent.name == "entries":
                pid = os.fork()
                if pid == 0:
                    time.sleep(600)
                    os._exit(0)
                print(pid, self.token, flush=True)
                time.sleep(600)

    layer = ForkInsideTheLock()
    s = BlockStore(sys.argv[1], model_id="m", config_fingerprint="fp-wedges", tokenizer_hash="t",
                   max_bytes=1 << 30, block_tokens=16, fs=layer)
    layer.token = s._intents.token
    tokens = random_tokens(40, seed=11)
    s.store(tokens, prefill(tiny_model("llama"), tokens)[0])
""")


def test_a_forked_child_holds_neither_the_lock_nor_its_parents_intents(tmp_path: Path, model: Any) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _FORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child_pid, token = parent.stdout.readline().split()
        child = int(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        os.kill(child, 0)  # the child lives on
        with open_store(tmp_path, lock_timeout=2.0, gc_grace=0.0) as s:
            assert s.store(random_tokens(40, seed=12), prefill(model, random_tokens(40, seed=12))[0])
            s.gc()
            assert token not in writers.survey(s.directory / "writers").live
            assert not (s.directory / "writers" / token).exists()  # the dead parent's intent file was reaped
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
