"""Last use survives the index: restores write it into the header's mtime (as
the seed does), so a rebuild for any reason — ``rebuild-index``, an index
lost or garbage, a reboot that left it unsettled — brings back the LRU order
it had, and the store order (``find``'s tie-break) comes from the entry ids.
A reboot after the index was settled costs no rebuild at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest

from blockkv import BlockStore
from blockkv.local.index import SETTLED
from blockkv.local.locks import DirLock
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="tiny-llama", config_fingerprint="tiny-llama@r1", tokenizer_hash="tok1")


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


class Clock:
    """Time that moves only when told to: every use is a distinct, known moment."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 10.0


def open_store(root: Path, clock: Clock) -> BlockStore:
    return BlockStore(root, max_bytes=1 << 30, clock=clock, **IDENT)


def store_in_turn(store: BlockStore, clock: Clock, model: Any, seeds: range) -> list[str]:
    """One 40-token entry per seed, each stored a tick after the last; their ids."""
    ids = []
    for seed in seeds:
        clock.tick()
        tokens = random_tokens(40, seed=seed)
        assert store.store(tokens, prefill(model, tokens)[0])
        ids.append(store.find_exact(tokens).entry.id)
    return ids


def lru(store: BlockStore) -> list[str]:
    """Every entry, in the order eviction would take them."""
    return [e.id for e in store.evict_plan(0)]


def rebuilt(store: BlockStore) -> bool:
    return any("rebuilt" in note for note in store.recovery)


def reboot(directory: Path, *, settled: bool) -> None:
    """What a reboot leaves: the index stamped by a boot that has ended, and
    ``index.settled`` if the last handle settled it (it closed, or went idle)
    but not if it was still writing (killed, or the power cut)."""
    stamp_an_ended_boot(directory)
    marker = directory / SETTLED
    assert marker.exists()  # the closing handle settled it
    if not settled:
        marker.unlink()


def stamp_an_ended_boot(directory: Path) -> None:
    """The index as a boot that has ended left it: stamped with that boot's id."""
    env = lmdb.open(str(directory / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"boot", b"a boot that has ended", db=env.open_db(b"meta", txn=txn))
    env.close()


@pytest.fixture
def used(tmp_path: Path, llama: Any) -> tuple[Path, Clock, list[str]]:
    """Six entries stored in turn, then the second, first and fourth restored in
    that order: the LRU order is 2, 4, 5, 1, 0, 3 (by store index)."""
    clock = Clock()
    with open_store(tmp_path, clock) as s:
        ids = store_in_turn(s, clock, llama, range(300, 306))
        entries = {e.id: e for e in s.entries()}
        for k in (1, 0, 3):
            clock.tick()
            assert s.restore(entries[ids[k]]) is not None
        order = [ids[k] for k in (2, 4, 5, 1, 0, 3)]
        assert lru(s) == order
        directory = s.directory
    return directory, clock, order


def test_rebuild_index_keeps_the_lru_order(used: tuple[Path, Clock, list[str]]) -> None:
    directory, clock, order = used
    with open_store(directory.parent, clock) as s:
        s.rebuild_index()
        assert lru(s) == order


def test_a_lost_or_garbage_index_keeps_the_lru_order(used: tuple[Path, Clock, list[str]]) -> None:
    directory, clock, order = used
    shutil.rmtree(directory / "index")
    with open_store(directory.parent, clock) as s:
        assert rebuilt(s) and lru(s) == order
    (directory / "index" / "data.mdb").write_bytes(b"\0garbage" * 1024)
    with open_store(directory.parent, clock) as s:
        assert rebuilt(s) and lru(s) == order


def test_a_reboot_rebuilds_an_unsettled_index_and_keeps_the_lru_order(
        used: tuple[Path, Clock, list[str]]) -> None:
    directory, clock, order = used
    reboot(directory, settled=False)
    with open_store(directory.parent, clock) as s:
        assert rebuilt(s) and lru(s) == order


def test_a_reboot_trusts_a_settled_index(used: tuple[Path, Clock, list[str]]) -> None:
    directory, clock, order = used
    reboot(directory, settled=True)
    with open_store(directory.parent, clock) as s:
        assert not rebuilt(s) and lru(s) == order
        assert s.check().clean


def test_a_rebuild_keeps_the_store_order_of_ties(tmp_path: Path, llama: Any) -> None:
    """``find`` gives a tie to the entry stored first; restoring that entry later
    moves its mtime, not its place."""
    clock = Clock()
    base = random_tokens(60, seed=7)
    first, second = base + random_tokens(20, seed=8), base + random_tokens(20, seed=9)
    prompt = base + random_tokens(20, seed=10)  # shares exactly ``base`` with both
    with open_store(tmp_path, clock) as s:
        for tokens in (first, second):
            clock.tick()
            assert s.store(tokens, prefill(llama, tokens)[0])
        winner = s.find(prompt).entry
        assert winner.tokens == tuple(first)
        clock.tick()
        assert s.restore(s.find_exact(second).entry) is not None
        s.rebuild_index()
        assert s.find(prompt).entry.id == winner.id


def test_a_use_the_index_has_not_seen_is_not_evicted(tmp_path: Path, llama: Any) -> None:
    """A restore that found the directory lock busy leaves its use with its
    handle; another handle's eviction reads the header's mtime, so it evicts
    the entry that really was used least recently."""
    clock = Clock()
    with open_store(tmp_path, clock) as a, open_store(tmp_path, clock) as b:
        ids = store_in_turn(a, clock, llama, range(400, 403))
        oldest = next(e for e in a.entries() if e.id == ids[0])
        busy = DirLock(a.directory / "LOCK")  # another holder of the lock: flock is per open file
        with busy.held(None):
            clock.tick()
            assert a.restore(oldest) is not None  # its use is not in the index yet
        busy.close()
        assert [e.id for e in b.evict_plan(0)] == [ids[1], ids[2], ids[0]]
        assert b.evict_to(b.total_bytes - 1)[0].id == ids[1]



_KILLED_AFTER_STORE = """
import os, sys, time
import blockkv.local.index_keeper as keeper
from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model
keeper.SETTLE_AFTER = 0.2
root, idle = sys.argv[1], sys.argv[2] == "idle"
store = BlockStore(root, max_bytes=1 << 30, model_id="tiny-llama", config_fingerprint="tiny-llama@r1",
                   tokenizer_hash="tok1")
model, settled = tiny_model("llama"), store.directory / "index.settled"
for seed in (600, 601):
    tokens = random_tokens(40, seed=seed)
    assert store.store(tokens, prefill(model, tokens)[0])
    assert not settled.exists()  # a write removes the proof before it writes
    deadline = time.monotonic() + 30
    while idle and not settled.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled.exists() == idle
os._exit(0)  # killed: no close, no settle
"""


@pytest.mark.parametrize("idle", [True, False])
def test_a_killed_server_that_went_idle_costs_no_rebuild_at_a_reboot(tmp_path: Path, idle: bool) -> None:
    """A server is killed at a reboot, never closing its store: a handle settles
    the index once it has written nothing for a while, so a reboot after it
    went idle trusts the index; one killed while writing leaves it unsettled."""
    subprocess.run([sys.executable, "-c", _KILLED_AFTER_STORE, str(tmp_path), "idle" if idle else "busy"],
                   check=True, timeout=300)
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    if idle:
        reboot(directory, settled=True)
    else:
        stamp_an_ended_boot(directory)
    with open_store(tmp_path, Clock()) as s:
        assert rebuilt(s) != idle and len(s) == 2


def test_a_handle_that_could_not_recover_an_unsettled_index_does_not_settle_it(tmp_path: Path, llama: Any) -> None:
    """After a reboot that left the index unsettled, a handle that opens while
    another holds the lock serves without recovering (recovery waits for the
    lock); closing it must not declare those unrecovered tables settled, or
    every later open would trust them."""
    clock = Clock()
    with open_store(tmp_path, clock) as s:
        store_in_turn(s, clock, llama, range(2))
        directory = s.directory
    reboot(directory, settled=False)
    other = DirLock(directory / "LOCK")
    with other.held(None):
        deferred = BlockStore(tmp_path, max_bytes=1 << 30, clock=clock, lock_timeout=0.1, **IDENT)
    deferred.close()
    assert not (directory / SETTLED).exists()
    with open_store(tmp_path, clock) as s:
        assert rebuilt(s) and len(s) == 2
