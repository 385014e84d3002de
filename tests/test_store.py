"""BlockStore: the seed's rules, dedup, persistence, identity and recovery, on real caches."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from blockkv import BlockStore, GenerationCheckpoint, minimum_reusable_offset
from blockkv.format.layout import fingerprint_dirname
from blockkv.testing.models import chunked_cache_fills, prefill, random_tokens, tiny_model

IDENT = dict(model_id="tiny-llama", config_fingerprint="tiny-llama@r1", tokenizer_hash="tok1")


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mamba() -> Any:
    return tiny_model("mamba")


def open_store(root: Path, **kw: Any) -> BlockStore:
    args = {**IDENT, "max_bytes": 1 << 30, **kw}
    return BlockStore(root, **args)


def caches_for(model: Any, tokens: list[int]) -> list[Any]:
    cache, _ = prefill(model, tokens)
    return cache


def bits(a: mx.array) -> np.ndarray:
    """Raw bits of an array, whatever its dtype (bf16 has no numpy dtype)."""
    flat = a.reshape(-1)
    return np.array(flat.view(mx.uint8)) if a.dtype.size == 1 else np.array(flat.view(mx.uint16))


def kv_bits(caches: list[Any], n: int) -> list[np.ndarray]:
    return [bits(c.keys[..., :n, :]) for c in caches] + [bits(c.values[..., :n, :]) for c in caches]


def assert_same_kv(restored: list[Any], original: list[Any], n: int) -> None:
    assert all(c.offset == n for c in restored)
    for a, b in zip(kv_bits(restored, n), kv_bits(original, n)):
        assert np.array_equal(a, b)


def block_files(store: BlockStore) -> list[Path]:
    return [p for p in (store.directory / "blobs").rglob("*") if p.is_file()]


def header_files(store: BlockStore) -> list[Path]:
    return sorted((store.directory / "entries").rglob("*.bkv"))


# -- rule 1: find -------------------------------------------------------------------------


def test_find_longest_prefix_capped_and_first_on_ties(tmp_path: Path, llama: Any) -> None:
    base = random_tokens(300, seed=1)
    a, b = base[:200], base[:200] + random_tokens(50, seed=2)
    with open_store(tmp_path) as s:
        assert s.store(base, caches_for(llama, base))
        m = s.find(base)  # the whole prompt is stored: capped at len - 1
        assert m is not None and m.prefix_len == len(base) - 1
        assert s.find(base[:1]) is None  # p would be 0
        assert s.find(random_tokens(10, seed=9)) is None
        assert s.find(base, ns="other") is None
        # two siblings give p == 200 for this prompt; the first stored keeps it
        s2 = [*a, *random_tokens(40, seed=3)]
        assert s.store(s2, caches_for(llama, s2))
        m = s.find(a + [7, 7, 7])
        assert m is not None and m.prefix_len == 200 and m.entry.tokens == tuple(base)
        assert s.find(b) is not None and s.find(b).prefix_len == 200


def test_find_skips_untrimmable_longer_entries(tmp_path: Path, mamba: Any) -> None:
    """The seed's restart-0 defect: an SSM [prompt+gen] entry must not outrank
    the boundary snapshot it cannot be cut back to."""
    system = random_tokens(64, seed=4)
    turn = system + random_tokens(32, seed=5)
    with open_store(tmp_path) as s:
        assert s.store(system, caches_for(mamba, system))
        assert s.store(turn, caches_for(mamba, turn))  # untrimmable: does not supersede
        assert len(s) == 2
        prompt = system + random_tokens(10, seed=6)
        m = s.find(prompt)
        assert m is not None and m.entry.tokens == tuple(system) and m.prefix_len == 64
        assert s.find(turn + [1]).entry.tokens == tuple(turn)


@pytest.mark.skipif(not chunked_cache_fills(), reason="this mlx-lm's ChunkedKVCache fails past one chunk "
                    "(mlx-lm's bug, fixed in 0.32)")
def test_find_respects_minimum_reusable_offset(tmp_path: Path) -> None:
    chunked = tiny_model("chunked")
    tokens = random_tokens(200, seed=7)
    caches, _ = prefill(chunked, tokens, chunk=50)  # the front is dropped between forward passes
    assert max(getattr(c, "start_position", 0) for c in caches) > 0, "the front must be dropped"
    mro = minimum_reusable_offset(caches)
    assert mro > 0
    with open_store(tmp_path) as s:
        assert s.store(tokens, caches)
        (entry,) = s.entries()
        assert entry.minimum_reusable_offset == mro
        assert s.find(tokens[: mro - 1] + [255, 255]) is None
        m = s.find(tokens[: mro + 5] + [255])
        assert m is not None and m.prefix_len == mro + 5
        assert s.has_durable_prefix(tokens[: mro + 5]) and not s.has_durable_prefix(tokens[: mro - 1])


# -- rules 2, 3: find_exact, has_durable_prefix ------------------------------------------------


def test_find_exact_and_durable_prefix(tmp_path: Path, llama: Any, mamba: Any) -> None:
    t = random_tokens(100, seed=8)
    with open_store(tmp_path) as s:
        assert s.store(t, caches_for(llama, t))
        assert s.find_exact(t).entry.tokens == tuple(t)
        assert s.find_exact(t[:-1]) is None and s.find_exact(t, ns="x") is None
        assert s.has_durable_prefix(t) and s.has_durable_prefix(t[:10])
        assert not s.has_durable_prefix(t + [1]) and not s.has_durable_prefix(t[:10], ns="x")
        assert s.longest_durable_prefix_tokens == 100
        assert list(s.token_prefixes()) == [tuple(t)]
    with open_store(tmp_path / "ssm") as s:
        assert s.store(t, caches_for(mamba, t))
        assert s.has_durable_prefix(t) and not s.has_durable_prefix(t[:10])


# -- rules 4, 5: store, replace, supersede, refuse --------------------------------------------


def test_store_replaces_identical_and_supersedes_prefixes(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(120, seed=10)
    with open_store(tmp_path) as s:
        assert s.store(t[:50], caches_for(llama, t[:50]))
        assert s.store(t[:50], caches_for(llama, t[:50]), ns="other")
        first = s.find_exact(t[:50]).entry
        assert s.store(t[:50], caches_for(llama, t[:50]))  # identical: replaced
        assert len(s) == 2 and s.find_exact(t[:50]).entry.id != first.id
        assert s.store(t, caches_for(llama, t))  # trimmable: supersedes its prefix in its ns only
        assert len(s) == 2
        assert s.find_exact(t[:50]) is None and s.find_exact(t[:50], ns="other") is not None
        assert len(header_files(s)) == 2


def test_attachments_make_an_entry_untrimmable(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(80, seed=11)
    logits = mx.arange(12, dtype=mx.bfloat16).reshape(3, 4)
    with open_store(tmp_path) as s:
        assert s.store(t[:40], caches_for(llama, t[:40]))
        assert s.store(t, caches_for(llama, t), attachments={"logits": logits})
        assert len(s) == 2  # an untrimmable entry never supersedes
        entry = s.find_exact(t).entry
        assert not entry.trimmable and entry.attachments == ("logits",)
        loaded = s.restore(entry)
        assert np.array_equal(bits(loaded.attachments["logits"]), bits(logits))
        with pytest.raises(ValueError, match="cannot be trimmed"):
            s.restore(entry, prefix_len=10)


def test_entry_over_the_cap_is_refused(tmp_path: Path, llama: Any, caplog: Any) -> None:
    t = random_tokens(300, seed=12)
    with open_store(tmp_path, max_bytes=10_000) as s, caplog.at_level(logging.WARNING, "blockkv"):
        assert s.store(t, caches_for(llama, t)) is False
        assert len(s) == 0 and not block_files(s) and "exceeds" in caplog.text


# -- rule 6: generation checkpoints -------------------------------------------------------


def test_generation_checkpoints(tmp_path: Path, llama: Any) -> None:
    prompt = random_tokens(60, seed=13)
    gen = prompt + random_tokens(30, seed=14)
    with open_store(tmp_path) as s:
        cp = GenerationCheckpoint("req-1", original_prompt_tokens=len(prompt))
        assert s.store_generation_checkpoint(gen[:75], caches_for(llama, gen[:75]), cp)
        assert s.store_generation_checkpoint(gen, caches_for(llama, gen), cp)
        found = s.find_generation_checkpoint(prompt, "req-1")
        assert found is not None and found.length == len(gen)
        assert len([e for e in s.entries() if e.checkpoint]) == 1  # the older point was superseded
        assert s.find(prompt + [1]) is None  # never seeds an unrelated prefill
        assert s.find_generation_checkpoint(prompt[:-1], "req-1") is None
        assert s.find_generation_checkpoint(prompt, "req-2") is None
        assert s.find_generation_checkpoint(prompt, "req-1", cache_ns="x") is None
        s.remove_generation_checkpoints("req-1")
        assert s.find_generation_checkpoint(prompt, "req-1") is None and len(s) == 0


# -- rule 7: LRU eviction -------------------------------------------------------------------


def test_lru_eviction_bumped_by_restore(tmp_path: Path, llama: Any) -> None:
    now = [1000.0]
    seqs = [random_tokens(100, seed=20 + i) for i in range(3)]
    with open_store(tmp_path, clock=lambda: now[0]) as s:
        for t in seqs:
            now[0] += 1
            assert s.store(t, caches_for(llama, t))
        sizes = {e.tokens: e.nbytes for e in s.entries()}
        now[0] += 1
        assert s.restore(s.find_exact(seqs[0]).entry) is not None  # seqs[0] is now the most recent
        target = s.total_bytes - 1
        plan = s.evict_plan(target)
        assert [e.tokens for e in plan] == [tuple(seqs[1])]
        assert len(s) == 3  # a plan changes nothing
        s.evict_to(target)
        assert s.find_exact(seqs[1]) is None and len(s) == 2
        assert s.total_bytes <= target
        assert s.total_bytes == sum(v for k, v in sizes.items() if k != tuple(seqs[1]))


def test_live_limit_is_the_cap(tmp_path: Path, llama: Any) -> None:
    cap = [1 << 30]
    t1, t2 = random_tokens(100, seed=30), random_tokens(100, seed=31)
    with open_store(tmp_path, limit=lambda: cap[0]) as s:
        assert s.store(t1, caches_for(llama, t1))
        cap[0] = s.total_bytes + 1000
        assert s.max_bytes == cap[0]
        assert s.store(t2, caches_for(llama, t2))  # storing evicts the older entry to fit
        assert len(s) == 1 and s.find_exact(t2) is not None and s.total_bytes <= cap[0]


def test_a_namespace_past_its_share_evicts_its_own_lru_entries(tmp_path: Path, llama: Any) -> None:
    """namespace_share: a namespace's store that takes it past its share of the
    cap evicts that namespace's least recently used entries; another namespace's
    and the default one's are untouched, and the cap is far from reached."""
    now = [1000.0]
    seqs = [random_tokens(100, seed=40 + i) for i in range(4)]
    with open_store(tmp_path, clock=lambda: now[0], isolate_namespaces=True) as s:
        for ns, t in (("other", seqs[0]), ("", seqs[1])):
            assert s.store(t, caches_for(llama, t), ns)
        one = s.entries("other")[0].nbytes  # every entry here is the same size
        s.namespace_share = 2.5 * one / s.max_bytes  # room for two entries per namespace
        for t in [seqs[2], seqs[3], seqs[0]]:
            now[0] += 1
            assert s.store(t, caches_for(llama, t), "greedy")
        assert {e.tokens for e in s.entries("greedy")} == {tuple(seqs[3]), tuple(seqs[0])}  # its LRU one went
        assert len(s.entries("other")) == 1 and len(s.entries("")) == 1
        assert s.total_bytes < s.max_bytes / 2
    with pytest.raises(ValueError, match="namespace_share"):
        open_store(tmp_path, namespace_share=1.5)


# -- rules 8, 9: restore, bad input -----------------------------------------------------------


def test_restore_full_and_partial_bit_exact(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(700, seed=40)
    caches = caches_for(llama, t)
    with open_store(tmp_path, compression="zstd") as s:
        assert s.store(t, caches)
        entry = s.find_exact(t).entry
        assert_same_kv(s.restore(entry).caches, caches, 700)
        reads: list[str] = []
        real_read = s._dir.pool.read_exact
        s._dir.pool.read_exact = lambda name, bufs, on_read=None: reads.append(name) or real_read(name, bufs, on_read)  # type: ignore[method-assign]
        loaded = s.restore(entry, prefix_len=300)
        assert len(reads) == 2  # ceil(300 / 256) token blocks, nothing else
        assert loaded.tokens == tuple(t[:300])
        assert_same_kv(loaded.caches, caches, 300)
        assert s.stats["restores"] == 2 and s.stats["restore_ms_last"] > 0


def test_restore_async_and_store_async(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(90, seed=41)
    caches = caches_for(llama, t)
    with open_store(tmp_path) as s:
        fut = s.store_async(t, caches)
        assert fut.result(timeout=60) is True
        loaded = s.restore_async(s.find_exact(t).entry).result(timeout=60)
        assert_same_kv(loaded.caches, caches, 90)


def test_bad_arguments_raise_clear_errors(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(20, seed=42)
    caches = caches_for(llama, t)
    with pytest.raises(ValueError, match="max_bytes"):
        open_store(tmp_path, max_bytes=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        open_store(tmp_path, block_tokens=0)
    with open_store(tmp_path) as s:
        with pytest.raises(TypeError, match="tokens must be ints"):
            s.store([1, 2.5], caches)
        with pytest.raises(TypeError, match="tokens must be a sequence"):
            s.find("hello")
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            s.find([-1, 2])
        with pytest.raises(TypeError, match="ns must be a str"):
            s.store(t, caches, ns=3)  # type: ignore[arg-type]
        batch = copy.deepcopy(caches)
        for c in batch:
            c.keys = mx.concatenate([c.keys, c.keys])
            c.values = mx.concatenate([c.values, c.values])
        with pytest.raises(ValueError, match="batch"):
            s.store(t, batch)
        with pytest.raises(TypeError, match="object"):
            s.store(t, [object()])
        with pytest.raises(ValueError, match="target_bytes"):
            s.evict_to(-5)
        assert len(s) == 0


# -- dedup -------------------------------------------------------------------------------------


def test_twenty_entries_share_their_prefix_blocks(tmp_path: Path, llama: Any) -> None:
    prefix = random_tokens(1000, seed=50)
    base, _ = prefill(llama, prefix)
    entries = []
    with open_store(tmp_path) as s:
        totals = [s.total_bytes]
        for i in range(20):
            tokens = prefix + random_tokens(60, seed=100 + i)
            cache = copy.deepcopy(base)
            prefill(llama, tokens[1000:], cache=cache)
            assert s.store(tokens, cache)
            entries.append((tokens, cache))
            totals.append(s.total_bytes)
        shared = [n for n in s.entries()[0].blocks if all(n in e.blocks for e in s.entries())]
        assert len(shared) == 3  # blocks [0,256), [256,512), [512,768)
        assert len(block_files(s)) == 3 + 20 * 2
        own = [e.nbytes - sum(s._index.block(n).size for n in shared) for e in s.entries()]
        growth = np.diff(totals)
        assert growth[0] == s.entries()[0].nbytes
        assert sorted(growth[1:]) == sorted(own[1:]) or sum(growth[1:]) == sum(own) - own[0]
        for e in s.entries()[:19]:
            s.remove(e)
        last_tokens, last_cache = entries[-1]
        loaded = s.restore(s.find_exact(last_tokens).entry)
        assert_same_kv(loaded.caches, last_cache, 1060)
        s.remove(s.find_exact(last_tokens).entry)
    with open_store(tmp_path, gc_grace=0) as s:
        assert len(s) == 0 and s.total_bytes == 0 and block_files(s) == []
    assert s.stats["bytes_deduplicated"] == 0  # a fresh handle counts its own work only


# -- persistence ---------------------------------------------------------------------------------


def _two_entries(root: Path, llama: Any) -> tuple[list[int], list[int], list[Any]]:
    a = random_tokens(300, seed=60)
    b = a[:200] + random_tokens(100, seed=61)
    cb = caches_for(llama, b)
    with open_store(root) as s:
        assert s.store(a, caches_for(llama, a)) and s.store(b, cb)
    return a, b, cb


def _assert_found(root: Path, a: list[int], b: list[int], cb: list[Any]) -> BlockStore:
    s = open_store(root)
    assert len(s) == 2
    assert s.find(a + [1]).prefix_len == 300 and s.find(b + [1]).prefix_len == 300
    assert_same_kv(s.restore(s.find_exact(b).entry).caches, cb, 300)
    assert s.check().clean
    return s


def test_reopen_finds_everything(tmp_path: Path, llama: Any) -> None:
    a, b, cb = _two_entries(tmp_path, llama)
    _assert_found(tmp_path, a, b, cb).close()


@pytest.mark.parametrize("damage", ["delete", "garbage", "truncate"])
def test_lmdb_loss_loses_nothing(tmp_path: Path, llama: Any, damage: str) -> None:
    a, b, cb = _two_entries(tmp_path, llama)
    index = tmp_path / fingerprint_dirname(IDENT["config_fingerprint"]) / "index"
    if damage == "delete":
        shutil.rmtree(index)
    elif damage == "garbage":
        (index / "data.mdb").write_bytes(os.urandom(8192))
    else:
        with open(index / "data.mdb", "r+b") as f:
            f.truncate(100)
    s = _assert_found(tmp_path, a, b, cb)
    assert any("rebuilt" in r for r in s.recovery)
    s.close()


def test_headers_added_and_removed_behind_the_index(tmp_path: Path, llama: Any) -> None:
    a, b, cb = _two_entries(tmp_path, llama)
    with open_store(tmp_path) as s:
        victim = s._dir.header_path("", s.find_exact(a).entry.id)
    stash = tmp_path / "stash"
    shutil.move(victim, stash)
    with open_store(tmp_path) as s:  # removed behind its back: dropped, references given back
        assert len(s) == 1 and s.find_exact(a) is None and s.find_exact(b) is not None
        assert s.check().clean
    shutil.move(stash, victim)  # added behind its back (its blocks still await gc)
    with open_store(tmp_path) as s:
        assert any("found on disk" in r for r in s.recovery)
    _assert_found(tmp_path, a, b, cb).close()


# -- identity ---------------------------------------------------------------------------------------


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_foreign_fingerprints_and_models_are_untouched(tmp_path: Path, llama: Any) -> None:
    t = random_tokens(120, seed=70)
    other = dict(IDENT, config_fingerprint="other-model@r9")
    with open_store(tmp_path, **other) as s:
        assert s.store(t, caches_for(llama, t))
    foreign_dir = tmp_path / fingerprint_dirname("other-model@r9")
    before = _snapshot(foreign_dir)
    # a header naming another model inside our own directory
    with open_store(tmp_path, model_id="someone-else") as s:
        assert s.store(t, caches_for(llama, t))
        foreign_header = header_files(s)[0]
    header_bytes = foreign_header.read_bytes()
    with open_store(tmp_path) as s:  # never served, never cleaned away, reported as foreign
        assert len(s) == 0 and s.find(t + [1]) is None and s.find_exact(t) is None
        s.evict_to_cap()
        s.gc()
        report = s.check()
        assert report.clean and report.foreign_headers == [str(foreign_header.relative_to(s.directory))]
        assert s.total_bytes == 0  # its bytes are not ours to count
    assert foreign_header.read_bytes() == header_bytes
    with open_store(tmp_path, max_bytes=1) as s:  # a 1-byte cap counts and evicts its own identity's entries only
        s.evict_to_cap()
        assert s.evict_to(0) == [] and foreign_header.read_bytes() == header_bytes
    with open_store(tmp_path, model_id="someone-else") as s:
        assert_same_kv(s.restore(s.find_exact(t).entry).caches, caches_for(llama, t), 120)
    assert _snapshot(foreign_dir) == before  # another fingerprint directory is never touched


def test_identities_sharing_a_directory_each_keep_their_own_cap(
        tmp_path: Path, llama: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The seed's rule: another identity's entries are never ours to delete or
    serve. Two chat templates of one model in one directory (a configuration
    mistake, warned about once per handle): each handle's cap counts and evicts
    its own identity's entries, least recently used first, never the other's."""
    cap = 160_000  # about three of these entries
    acked: dict[int, list[list[int]]] = {0: [], 1: []}
    for i in range(8):
        t = random_tokens(100, seed=200 + i)
        with caplog.at_level(logging.WARNING, "blockkv"), \
                open_store(tmp_path, tokenizer_hash=f"tok{i % 2}", max_bytes=cap) as s:
            caplog.clear()
            assert s.store(t, caches_for(llama, t)) and s.store(t, caches_for(llama, t))
            assert s.find_exact(t) is not None  # not evicted at once
            assert s.total_bytes <= cap
            acked[i % 2].append(t)
            if i:
                assert sum("another identity" in r.getMessage() for r in caplog.records) == 1
    for ident, mine in acked.items():
        with open_store(tmp_path, tokenizer_hash=f"tok{ident}", max_bytes=cap) as s:
            kept = [t for t in mine if s.find_exact(t) is not None]
            assert 2 <= len(kept) < len(mine) and kept == mine[-len(kept):]  # its own oldest went
            assert s.check().clean
    with open_store(tmp_path, tokenizer_hash="tok0", max_bytes=1) as s:  # a 1-byte cap: every entry of its own goes
        s.evict_to_cap()
        assert len(s) == 0
    with open_store(tmp_path, tokenizer_hash="tok1", max_bytes=cap) as s:
        assert len(s) >= 2  # and none of the other identity's


# -- recovery -----------------------------------------------------------------------------------------


def test_tmp_orphans_fresh_kept_old_reaped(tmp_path: Path, llama: Any) -> None:
    now = [10_000.0]
    with open_store(tmp_path, clock=lambda: now[0], tmp_grace=100) as s:
        t = random_tokens(40, seed=80)
        assert s.store(t, caches_for(llama, t))
        shard = header_files(s)[0].parent
    fresh, old = shard / ".x.bkv.aaaa.tmp", shard / ".y.bkv.bbbb.tmp"
    fresh.write_bytes(b"live writer")
    old.write_bytes(b"dead writer")
    os.utime(fresh, (now[0] - 10, now[0] - 10))
    os.utime(old, (now[0] - 1000, now[0] - 1000))
    with open_store(tmp_path, clock=lambda: now[0], tmp_grace=100) as s:
        assert fresh.exists() and not old.exists() and len(s) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_header_is_removed_and_never_served(tmp_path: Path, llama: Any, damage: str) -> None:
    a, b, cb = _two_entries(tmp_path, llama)
    with open_store(tmp_path) as s:
        victim = s._dir.header_path("", s.find_exact(a).entry.id)
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 3] ^= 0x40
        victim.write_bytes(bytes(data))
    shutil.rmtree(victim.parents[2] / "index")  # force a rebuild that reads every header
    with open_store(tmp_path) as s:
        assert not victim.exists() and s.find_exact(a) is None and len(s) == 1
        assert s.check().clean
    # the same damage under a live index is caught at restore time
    _two_entries(tmp_path / "live", llama)
    with open_store(tmp_path / "live") as s:
        entry = s.find_exact(a).entry
        path = s._dir.header_path("", entry.id)
        path.write_bytes(path.read_bytes()[:-5])
        assert s.restore(entry) is None and s.find_exact(a) is None and not path.exists()


def test_corrupt_block_fails_restore_and_drops_the_entry(tmp_path: Path, llama: Any, caplog: Any) -> None:
    t = random_tokens(100, seed=81)
    with open_store(tmp_path) as s:
        assert s.store(t, caches_for(llama, t))
        (blob,) = block_files(s)
        data = bytearray(blob.read_bytes())
        data[-7] ^= 0x01
        blob.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, "blockkv"):
            assert s.restore(s.find_exact(t).entry) is None
        assert "restore failed" in caplog.text
        assert s.find_exact(t) is None and len(s) == 0
        assert s.check().clean


# -- several processes -----------------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import sys, time, random
    import numpy as np
    from blockkv import BlockStore
    from blockkv.testing.models import prefill, random_tokens, tiny_model
    root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    model = tiny_model("llama")
    rng = random.Random(seed)
    shared = random_tokens(300, seed=999)
    s = BlockStore(root, model_id="tiny-llama", config_fingerprint="tiny-llama@r1", tokenizer_hash="tok1",
                   max_bytes=3_000_000, gc_grace=0.5)
    stored = restored = 0
    end = time.time() + seconds
    while time.time() < end:
        tokens = shared + random_tokens(rng.randrange(1, 200), seed=rng.randrange(10**6))
        cache, _ = prefill(model, tokens)
        stored += s.store(tokens, cache)
        m = s.find(tokens[:-1] + [0])
        if m is not None:
            loaded = s.restore(m.entry, prefix_len=m.prefix_len if m.entry.trimmable else None)
            if loaded is not None:
                assert loaded.caches[0].offset in (m.prefix_len, m.entry.length)
                restored += 1
        if rng.random() < 0.2:
            s.gc()
    s.close()
    print(stored, restored)
    """
)


def test_two_processes_share_one_root(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path), str(seed), "6"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        stored, restored = map(int, out.split())
        assert stored > 0 and restored > 0
    time.sleep(0.6)
    with open_store(tmp_path, max_bytes=3_000_000, gc_grace=0.5) as s:
        report = s.check()
        assert report.clean, report
        assert s.total_bytes <= 3_000_000


def test_restore_with_blocks_of_mixed_sizes(tmp_path: Path) -> None:
    """A wrapped ring is a whole-tensor block bigger than the token blocks: the
    restore's reused read buffer must take blocks of every size in any order."""
    gemma = tiny_model("gemma3")
    t = random_tokens(60, seed=90)
    caches = caches_for(gemma, t)
    with open_store(tmp_path, block_tokens=4) as s:
        assert s.store(t, caches)
        loaded = s.restore(s.find_exact(t).entry)
        assert loaded is not None
        for got, want in zip(loaded.caches, caches):
            n = min(want.offset, want.keys.shape[-2])
            assert np.array_equal(bits(got.keys[..., :n, :]), bits(want.keys[..., :n, :]))


def test_reprs_say_what_without_every_token_or_block(tmp_path: Path, llama: Any) -> None:
    tokens = random_tokens(300, seed=12)
    with open_store(tmp_path) as s:
        assert s.store(tokens, caches_for(llama, tokens))
        (entry,) = s.entries()
        assert "tokens=300" in repr(entry) and f"blocks={len(entry.blocks)}" in repr(entry)
        assert entry.blocks[0] not in repr(entry) and len(repr(entry)) < 400
        assert repr(s).startswith("<BlockStore ") and "config_fingerprint=" in repr(s)
    assert repr(s).startswith("<BlockStore closed ")


def held_bytes(root: Path) -> int:
    """What the fingerprint directory holds in headers and blocks, as the files say."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()
               and ("blobs" in p.parts or p.suffix == ".bkv"))


def test_the_cap_bounds_the_disk_blocks_waiting_out_their_grace_included(tmp_path: Path, llama: Any) -> None:
    """Distinct entries stored as fast as the store takes them, under a cap that
    holds about three: the bytes on disk never pass the cap, although every
    evicted entry's blocks are younger than the 60 s grace."""
    now = [1000.0]
    prompts = [random_tokens(128, seed=100 + i) for i in range(10)]
    size = sum(a.nbytes for c in caches_for(llama, prompts[0]) for a in (c.keys[..., :128, :], c.values[..., :128, :]))
    cap = 3 * size + 3 * 4096  # three entries' tensors and headers
    with open_store(tmp_path / "capped", max_bytes=cap, block_tokens=64, clock=lambda: now[0]) as s:
        held = []
        for tokens in prompts:
            assert s.store(tokens, caches_for(llama, tokens))
            held.append(held_bytes(tmp_path / "capped"))
            now[0] += 1.0  # a second apart: all within the grace
        assert max(held) <= cap, (held, cap)
        assert 2 <= len(s) <= 3
        # under the cap, a block freed past its grace goes with the next store, no gc run
        s.remove(s.entries()[0])
        freed = held_bytes(tmp_path / "capped")
        now[0] += s.gc_grace + 1
        assert s.store(prompts[0][:64], caches_for(llama, prompts[0][:64]))
        assert held_bytes(tmp_path / "capped") < freed
