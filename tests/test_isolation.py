"""Opt-in tenant isolation: with ``isolate_namespaces=True`` every namespace's
blocks are named with keyed blake3, so no block is shared across namespaces
and storing another tenant's prompt costs what an unseen one does. Default:
maximal dedup. Namespace-scoped listings in both modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from blockkv import BlockStore, ReadOnlyStore
from blockkv.local.catalog import footprint
from blockkv.local.reader import read_directory
from blockkv.store import CHECKPOINT_NS
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp", tokenizer_hash="t", max_bytes=1 << 30, block_tokens=16)
N = 40


@pytest.fixture(scope="module")
def filled() -> tuple[list[int], list[Any]]:
    tokens = random_tokens(N, seed=7)
    cache, _ = prefill(tiny_model("llama"), tokens)
    return tokens, cache


def _pool(s: BlockStore) -> set[str]:
    return {p.name for p in (s.directory / "blobs").rglob("*") if p.is_file()}


def _bits(caches: list[Any]) -> list[bytes]:
    return [np.array(a.reshape(-1).view(mx.uint32)).tobytes()
            for c in caches for a in (c.keys[..., :N, :], c.values[..., :N, :])]


def _restores(s: BlockStore, tokens: list[int], ns: str, cache: list[Any]) -> None:
    loaded = s.restore(s.find_exact(tokens, ns).entry)
    assert loaded is not None and _bits(loaded.caches) == _bits(cache)


@pytest.mark.parametrize("isolate", [True, False])
def test_two_namespaces_storing_one_prompt(tmp_path: Path, filled: tuple[list[int], list[Any]], isolate: bool) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, isolate_namespaces=isolate, **IDENT) as s:
        assert s.store(tokens, cache, "tenant-a")
        pool_a = _pool(s)
        written = s.stats["bytes_written"]
        assert s.store(tokens, cache, "tenant-b")
        pool_b = _pool(s) - pool_a
        if isolate:  # a second set, written in full: nothing tells tenant b that tenant a stored it
            # (names of equal length, so the two headers are equal in size too)
            assert len(pool_b) == len(pool_a) and s.stats["bytes_deduplicated"] == 0
            assert s.stats["bytes_written"] == 2 * written
        else:  # one set, shared
            assert not pool_b and s.stats["bytes_deduplicated"] > 0
        _restores(s, tokens, "tenant-a", cache)
        _restores(s, tokens, "tenant-b", cache)
        assert s.check().clean
    with BlockStore(tmp_path, isolate_namespaces=isolate, **IDENT) as s:  # a fresh reader verifies with the key
        _restores(s, tokens, "tenant-a", cache)
        _restores(s, tokens, "tenant-b", cache)


def test_isolated_and_shared_handles_on_one_root_leave_each_other_alone(
    tmp_path: Path, filled: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, isolate_namespaces=True, gc_grace=0.0, **IDENT) as iso, \
            BlockStore(tmp_path, gc_grace=0.0, **IDENT) as shared:
        assert iso.store(tokens, cache, "alice")
        assert shared.store(tokens, cache, "alice")
        assert len(iso) == 1 and len(shared) == 1  # each serves only its own mode's entries
        for s in (iso, shared):
            s.gc()
            report = s.check(repair=True)
            assert not report.corrupt_blocks and not report.orphan_blocks, report
        _restores(iso, tokens, "alice", cache)
        _restores(shared, tokens, "alice", cache)
        assert iso.check().clean and shared.check().clean


def test_both_modes_are_one_identity_counted_evicted_and_read_together(
    tmp_path: Path, filled: tuple[list[int], list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A directory switched to isolation (``serve --per-key-cache``) keeps its
    earlier entries: each handle serves its own mode's, and counts, evicts and
    lists the other's with them, never as another identity's."""
    tokens, cache = filled
    other = random_tokens(N, seed=8)
    other_cache, _ = prefill(tiny_model("llama"), other)
    with BlockStore(tmp_path, **IDENT) as shared, BlockStore(tmp_path, isolate_namespaces=True, **IDENT) as iso:
        assert shared.store(tokens, cache) and iso.store(other, other_cache, "key-a")
        assert len(shared) == 1 and len(iso) == 1  # each serves only its own mode's
        assert shared.find_exact(other, "key-a") is None and iso.find_exact(tokens) is None
        assert shared.total_bytes == iso.total_bytes == footprint([*shared.entries(), *iso.entries()],
                                                                  read_directory(shared.directory).block_sizes)
        ids = [e.id for e in (*shared.entries(), *iso.entries())]  # stored in this order: LRU first
        assert [e.id for e in shared.evict_plan(0)] == [e.id for e in iso.evict_plan(0)] == ids
        view = read_directory(shared.directory)
        assert sorted(e.id for e in view.entries) == sorted(ids) and not view.foreign
        with ReadOnlyStore.open_dir(shared.directory) as reader:  # reads each under its header's key
            assert sorted(e.id for e in reader.entries()) == sorted(ids)
            for t, ns, c in ((tokens, "", cache), (other, "key-a", other_cache)):
                loaded = reader.restore(reader.find_exact(t, ns).entry)
                assert loaded is not None and _bits(loaded.caches) == _bits(c)
        assert [e.id for e in shared.evict_to(0)] == ids
        assert len(iso) == 0 and iso.check().clean
    assert "another identity" not in caplog.text


def test_namespace_scoped_listings(tmp_path: Path, filled: tuple[list[int], list[Any]]) -> None:
    tokens, cache = filled
    short = tokens[:10]
    short_cache, _ = prefill(tiny_model("llama"), short)
    with BlockStore(tmp_path, isolate_namespaces=True, **IDENT) as s:
        assert s.store(tokens, cache, "alice")
        assert s.store(short, short_cache, "bob")
        assert [e.ns for e in s.entries("alice")] == ["alice"] and s.count("alice") == 1
        assert s.count("carol") == 0 and s.entries("carol") == []
        assert list(s.token_prefixes("bob")) == [tuple(short)]
        assert s.longest_entry_tokens("bob") == 10 and s.longest_entry_tokens("alice") == N
        # the unscoped forms still cover every namespace
        assert len(s) == s.count() == 2 and s.longest_durable_prefix_tokens == N
        assert sorted(map(len, s.token_prefixes())) == [10, N]
        with pytest.raises(ValueError, match="reserved"):
            s.entries(CHECKPOINT_NS + "k")


def test_check_verifies_keyed_blocks_and_repair_removes_a_corrupt_one(
    tmp_path: Path, filled: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, isolate_namespaces=True, **IDENT) as s:
        assert s.store(tokens, cache, "tenant-a")
        assert s.check().clean  # every keyed block verifies under its namespace's key
        victim = sorted(p for p in (s.directory / "blobs").rglob("*") if p.is_file())[0]
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF  # the payload's last byte: the frame still parses, the hash does not
        victim.write_bytes(bytes(data))
        report = s.check()
        assert report.corrupt_blocks == [victim.name] and report.dangling
        s.check(repair=True)
        assert not victim.exists() and s.find_exact(tokens, "tenant-a") is None
        assert s.check().clean
