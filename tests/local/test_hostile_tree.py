"""Hostile files inside a cache root: garbage files and directories, symlinks
named like our headers, blocks and shards. They are ignored (or reported by
``check``), never followed out of the root, never served, never deleted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp", tokenizer_hash="t", max_bytes=1 << 30, gc_grace=0.0,
             tmp_grace=0.0)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_garbage_and_symlinks_in_the_root_are_never_followed_or_served(tmp_path: Path) -> None:
    model = tiny_model("llama")
    tokens = random_tokens(40, seed=1)
    cache, _ = prefill(model, tokens)
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    with BlockStore(root, **IDENT) as s:
        assert s.store(tokens, cache)
        fp = s.directory
        header = next((fp / "entries").rglob("*.bkv"))
        block = next(p for p in (fp / "blobs").rglob("*") if p.is_file())
    # outside the root: a copy of a real header and block, and a directory of precious files
    (outside / "precious.txt").write_text("not yours")
    shutil.copy(header, outside / header.name)
    shutil.copy(block, outside / block.name)
    before_outside = _tree(outside)
    ns_dir = header.parent
    planted = {
        # symlinks named exactly like our files, pointing out of the root
        ns_dir / f"{'a' * 32}.bkv": outside / header.name,
        block.parent / ("b" * 64)[:64]: outside / block.name,
        fp / "blobs" / "cc": outside,  # a shard directory that is a link
        fp / "entries" / ("d" * 16): outside,  # a namespace directory that is a link
        ns_dir / ".stale.bkv.0000.tmp": outside / "precious.txt",  # a link named like our write orphan
    }
    for link, target in planted.items():
        if link.is_dir():
            link.rmdir()  # a shard the store made empty at open: swapped for a link
        link.symlink_to(target)
    (ns_dir / "notes.txt").write_text("garbage")  # not our name
    (ns_dir / f"{'e' * 32}.bkv").mkdir()  # a directory named like a header
    (fp / "blobs" / "zz").mkdir()  # a shard that is not hex
    (fp / "blobs" / "zz" / ("f" * 64)).write_bytes(b"not a block")
    (root / "random-dir").mkdir()  # not a fingerprint directory
    (root / "random-dir" / "file").write_bytes(b"x")
    with BlockStore(root, **IDENT) as s:
        assert len(s) == 1  # only the real entry
        assert [e.tokens for e in s.entries()] == [tuple(tokens)]
        loaded = s.restore(s.find_exact(tokens).entry)
        assert loaded is not None
        assert np.array_equal(np.array(loaded.caches[0].keys), np.array(cache[0].keys[..., :40, :]))
        s.gc()
        s.check(repair=True)
        assert s.check().clean
    for link in planted:
        assert link.is_symlink()  # never deleted, never replaced
    assert (ns_dir / "notes.txt").exists() and (ns_dir / f"{'e' * 32}.bkv").is_dir()
    assert (fp / "blobs" / "zz" / ("f" * 64)).exists()
    assert (root / "random-dir" / "file").exists()
    assert _tree(outside) == before_outside
    assert sorted(os.listdir(outside)) == sorted(["precious.txt", header.name, block.name])
