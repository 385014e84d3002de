"""What a node publishes for ``blockkv route``: salted chained digests, the
journal's events and snapshot, and the two hooks that feed it (mlx-lm's RAM
tier through ``ResidentPromptCache``, the disk through ``BlockStore.changes``).
Real mlx-lm caches from a tiny random-weight model, a real store on disk."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore
from blockkv.mlx_lm.identity import StoreIdentity
from blockkv.node.journal import Journal
from blockkv.node.residency_endpoint import DiskWatcher, ResidentPromptCache
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.wire.residency import (
    BLOCK_SIZE,
    digest_key,
    is_digest,
    prefix_digests,
    salt_check,
)

KEY = digest_key("test fleet")
WAIT_BOUND_S = 60.0  # a safety bound on waits for the disk watcher's thread (not a timing assertion)
IDENTITY = StoreIdentity("tiny", "fp-residency", "tok")
MODEL_KEY = ("tiny", None, None)


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


def _store(root: Path, **kw: Any) -> BlockStore:
    return BlockStore(root, model_id=IDENTITY.model_id, config_fingerprint=IDENTITY.config_fingerprint,
                      tokenizer_hash=IDENTITY.tokenizer_hash, max_bytes=1 << 30, block_tokens=64, **kw)


def test_digests_are_chained_salted_and_cover_whole_blocks_only() -> None:
    tokens = random_tokens(5 * BLOCK_SIZE + 7, seed=1)
    d = prefix_digests(tokens, KEY)
    assert len(d) == 5 and all(is_digest(x) for x in d)
    assert prefix_digests(tokens[: 3 * BLOCK_SIZE + 1], KEY) == d[:3]  # a prefix's digests are a prefix
    changed = list(tokens)
    changed[BLOCK_SIZE + 2] += 1  # one token of block 2: its digest and every later one differ
    assert [a == b for a, b in zip(prefix_digests(changed, KEY), d)] == [True, False, False, False, False]
    other = prefix_digests(tokens, digest_key("another fleet"))
    assert not set(other) & set(d)  # another salt: nothing comparable
    assert prefix_digests(tokens, digest_key("")) != d
    assert salt_check(KEY) == salt_check(digest_key("test fleet")) != salt_check(digest_key("another fleet"))
    assert prefix_digests(tokens[: BLOCK_SIZE - 1], KEY) == []


def test_the_salt_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKKV_FLEET_SALT", "test fleet")
    assert digest_key(None) == KEY
    with pytest.raises(TypeError):
        digest_key(b"bytes")  # type: ignore[arg-type]


def test_events_name_only_digests_that_appear_or_disappear() -> None:
    """Entries share prefixes: vLLM's BlockStored/BlockRemoved semantics per digest, with parents."""
    journal = Journal(KEY)
    system = random_tokens(3 * BLOCK_SIZE, seed=2)
    a = system + random_tokens(2 * BLOCK_SIZE, seed=3)
    b = system + random_tokens(BLOCK_SIZE, seed=4)
    da, db = prefix_digests(a, KEY), prefix_digests(b, KEY)
    journal.apply("RAM", [("a", a)])
    journal.apply("RAM", [("b", b)])
    journal.apply("RAM", [("a", a)])  # held already: no event
    journal.apply("RAM", removed=["a"])
    journal.apply("RAM", removed=["a", "never held"])  # nothing: no batch
    journal.apply("RAM", removed=["b"])
    answer = journal.read(0)
    assert answer["resync"] is False and answer["seq"] == 4 and answer["epoch"] == journal.epoch
    events = [b["events"] for b in answer["batches"]]
    assert [b["seq"] for b in answer["batches"]] == [1, 2, 3, 4]
    assert events[0] == [{"type": "BlockStored", "block_hashes": da, "parent_block_hash": None, "token_ids": [],
                          "block_size": BLOCK_SIZE, "lora_id": None, "medium": "RAM", "lora_name": None}]
    assert events[1][0]["block_hashes"] == db[3:] and events[1][0]["parent_block_hash"] == da[2]
    assert events[2] == [{"type": "BlockRemoved", "block_hashes": da[3:], "medium": "RAM"}]  # the shared 3 stay
    assert events[3] == [{"type": "BlockRemoved", "block_hashes": db, "medium": "RAM"}]
    assert journal.held("RAM") == set()
    assert journal.read(4)["batches"] == [] and journal.read(2)["seq"] == 4


def test_a_reader_that_fell_behind_or_ran_ahead_resyncs_from_the_snapshot() -> None:
    journal = Journal(KEY, keep=2)
    tokens = [random_tokens(BLOCK_SIZE, seed=i) for i in range(4)]
    for i, t in enumerate(tokens):
        journal.apply("DISK", [(i, t)])
    assert journal.read(1)["resync"] is True  # batch 2 is gone from the log
    assert journal.read(2)["resync"] is False and [b["seq"] for b in journal.read(2)["batches"]] == [3, 4]
    assert journal.read(9)["resync"] is True  # another life of the node
    snap = journal.snapshot()
    assert snap["seq"] == 4 and snap["salt_check"] == salt_check(KEY) and snap["remote"] is False
    assert set(snap["media"]["DISK"]) == {prefix_digests(t, KEY)[0] for t in tokens} and snap["media"]["RAM"] == []
    journal.apply("DISK", cleared=True)
    assert journal.read(4)["batches"][0]["events"] == [{"type": "AllBlocksCleared", "medium": "DISK"}]
    assert journal.snapshot()["media"]["DISK"] == []


def test_a_long_poll_returns_as_soon_as_a_batch_lands() -> None:
    journal = Journal(KEY)
    timer = threading.Timer(0.2, journal.apply, ("RAM", [("x", random_tokens(BLOCK_SIZE))]))
    timer.start()
    start = time.monotonic()
    answer = journal.read(0, wait=20)
    assert answer["seq"] == 1 and time.monotonic() - start < 15  # a bound against hanging, not a timing claim
    assert journal.read(1, wait=0.05)["batches"] == []  # nothing new: an empty answer after the wait


def test_changes_follow_the_index_log_and_reset_on_a_rebuild(tmp_path: Path, llama: Any) -> None:
    with _store(tmp_path) as store, _store(tmp_path) as other:
        first = store.changes()
        assert first.reset and first.added == ()
        tokens = random_tokens(100, seed=5)
        assert store.store(tokens, prefill(llama, tokens)[0])
        changes = store.changes(first.position)
        assert not changes.reset and [list(r.tokens) for r in changes.added] == [tokens]
        entry = store.entries()[0]
        other.remove(entry)  # another handle on the same root
        gone = store.changes(changes.position)
        assert gone.added == () and gone.removed == (entry.id,)
        assert store.changes(gone.position) == type(gone)(gone.position, False, (), ())
        more = random_tokens(80, seed=6)
        assert store.store(more, prefill(llama, more)[0])
        store.rebuild_index()  # another generation of the tables: the log cannot reach back
        rebuilt = store.changes(gone.position)
        assert rebuilt.reset and [list(r.tokens) for r in rebuilt.added] == [more]


def test_the_disk_watcher_journals_the_stores_own_entries(tmp_path: Path, llama: Any) -> None:
    journal = Journal(KEY)
    with _store(tmp_path) as store:
        watcher = DiskWatcher(journal, store)
        watcher.poll()
        tokens = random_tokens(3 * BLOCK_SIZE + 5, seed=7)
        assert store.store(tokens, prefill(llama, tokens)[0])
        store.store(tokens[:40], prefill(llama, tokens[:40])[0], ns="tenant")  # another namespace: not served
        watcher.poll()
        assert journal.held("DISK") == set(prefix_digests(tokens, KEY))
        store.evict_to(0)
        watcher.poll()
        assert journal.held("DISK") == set()
    watcher.poll()  # a closed store: a warning and a resync later, never an exception
    assert journal.held("DISK") == set()


def test_the_ram_tier_is_journalled_as_mlx_lm_inserts_evicts_and_trims(tmp_path: Path, llama: Any) -> None:
    journal = Journal(KEY)
    cache = ResidentPromptCache(2, cache_dir=tmp_path, journal=journal, model_key=MODEL_KEY,
                                identity=lambda key: IDENTITY, block_tokens=64)
    system = random_tokens(2 * BLOCK_SIZE, seed=8)
    turns = [system + random_tokens(BLOCK_SIZE + 3, seed=9 + i) for i in range(3)]
    try:
        c0 = prefill(llama, system)[0]
        cache.insert_cache(MODEL_KEY, system, c0, cache_type="system")
        assert journal.held("RAM") == set(prefix_digests(system, KEY))
        cache.insert_cache(("another model", None, None), turns[0], prefill(llama, turns[0])[0])  # not published
        assert journal.held("RAM") == set(prefix_digests(system, KEY))
        # LRU of 2: the other model's entry goes, and the system entry too (mlx-lm drops
        # the prefixes of a trimmable insert)
        cache.insert_cache(MODEL_KEY, turns[0], prefill(llama, turns[0])[0])
        assert journal.held("RAM") == set(prefix_digests(turns[0], KEY))
        cache.insert_cache(MODEL_KEY, turns[1], prefill(llama, turns[1])[0])
        assert journal.held("RAM") == set(prefix_digests(turns[0], KEY)) | set(prefix_digests(turns[1], KEY))
        cache.trim_to(n_sequences=1)
        assert journal.held("RAM") == set(prefix_digests(turns[1], KEY))
        cache.insert_cache(MODEL_KEY, turns[1], prefill(llama, turns[1])[0])  # the same key again: no event
        seq = journal.snapshot()["seq"]
        assert journal.read(seq - 1)["batches"][0]["events"][0]["type"] == "BlockRemoved"
        cache.trim_to(n_sequences=0)
        assert journal.held("RAM") == set()
        cache.flush()
        found, rest = cache.fetch_nearest_cache(MODEL_KEY, turns[0] + [1, 2])  # a disk hit, promoted to RAM
        assert found is not None and journal.held("RAM") == set(prefix_digests(turns[0][: len(turns[0]) - len(rest) + 2], KEY))
        restored = journal.snapshot()["restored"]  # what the restore took, for a router to price restores by
        assert restored["disk"]["tokens"] == len(turns[0]) + 2 - len(rest) and restored["disk"]["seconds"] > 0
        assert restored["bucket"] == {"tokens": 0, "seconds": 0.0} and journal.read(0)["restored"] == restored
        deadline = time.monotonic() + WAIT_BOUND_S  # the disk watcher polls every 0.25 s, later under load
        while not set(prefix_digests(turns[1], KEY)) <= journal.held("DISK"):
            assert time.monotonic() < deadline, journal.held("DISK")
            time.sleep(0.05)
        assert journal.snapshot()["remote"] is False
    finally:
        cache.close()


def test_the_disk_watcher_does_not_wait_behind_a_stopped_writer(tmp_path: Path, llama: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A process stopped inside a write transaction of the index: a poll reads
    nothing and returns at once (it waited the transaction lock's 10 s, then
    started over, before); once the process is continued the next poll
    follows the log from where it was."""
    from blockkv.testing.stopped import HOLDER_SEEDS, continued, ended, holder_caches, stopped_in_txn

    journal = Journal(KEY)
    with _store(tmp_path) as store:
        watcher = DiskWatcher(journal, store)
        watcher.poll()
        holder = stopped_in_txn(tmp_path, "write", dict(model_id=IDENTITY.model_id,
                                                        config_fingerprint=IDENTITY.config_fingerprint,
                                                        tokenizer_hash=IDENTITY.tokenizer_hash, max_bytes=1 << 30))
        try:
            started = time.monotonic()
            watcher.poll()
            assert time.monotonic() - started < 5.0  # well under the 10 s wait it took before
            assert continued(holder, WAIT_BOUND_S) == "stored"
        finally:
            ended(holder)
        tokens = random_tokens(3 * BLOCK_SIZE + 5, seed=11)
        assert store.store(tokens, prefill(llama, tokens)[0])
        watcher.poll()
        held = [tokens] + [holder_caches(seed)[0] for seed in HOLDER_SEEDS]  # the holder's entries too
        assert journal.held("DISK") == {d for t in held for d in prefix_digests(t, KEY)}
        assert journal.read(0)["resync"] is False
    assert "cannot follow" not in caplog.text
