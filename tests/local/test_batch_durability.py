"""Batch durability of one store's blocks, observed through the file-layer seam:
every new block is written and fsync'd under a tmp name before any is renamed,
each shard directory is fsync'd once after its renames, and only then are
references taken and the header written; a failed rename leaves no tmp file
and nothing referenced."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from blockkv.format.layout import is_block_name
from blockkv.fs import FileLayer
from blockkv.store import BlockStore
from blockkv.testing.faults import FaultyFileLayer
from blockkv.testing.stateful import live_bits
from blockkv.testing.strategies import make_caches


class OrderLog(FileLayer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def write_tmp(self, path: Path, parts, **kw):  # type: ignore[no-untyped-def]
        tmp, n = super().write_tmp(path, parts, **kw)
        self.events.append(("tmp-durable", path.name))
        return tmp, n

    def replace(self, src: Path, dst: Path) -> None:
        super().replace(src, dst)
        self.events.append(("rename", dst.name))

    def fsync_dir(self, path: Path) -> None:
        super().fsync_dir(path)
        self.events.append(("fsync-dir", str(path)))

    def crash_point(self, name: str) -> None:
        self.events.append(("point", name))


def _open(root: Path, fs: FileLayer) -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint="fp", tokenizer_hash="tok",
                      max_bytes=1 << 40, block_tokens=4, fs=fs)


def test_blocks_are_durable_as_a_batch_before_they_are_referenced(tmp_path: Path) -> None:
    fs = OrderLog()
    store = _open(tmp_path, fs)
    fs.events.clear()
    tokens = tuple(range(1, 30))
    assert store.store(tokens, make_caches("llama", tokens))
    ev = fs.events
    refs = ev.index(("point", "store:blocks-written"))
    blocks = [n for kind, n in ev[:refs] if kind == "tmp-durable" and is_block_name(n)]
    assert len(blocks) >= 8
    renames = [i for i, (kind, n) in enumerate(ev[:refs]) if kind == "rename" and is_block_name(n)]
    assert sorted(ev[i][1] for i in renames) == sorted(blocks)
    last_tmp = max(i for i, (kind, n) in enumerate(ev) if kind == "tmp-durable" and is_block_name(n))
    assert last_tmp < min(renames)  # nothing is named before every block is durable
    shards = {str(store._dir.pool.path(n).parent) for n in blocks}
    dir_syncs = [n for kind, n in ev[max(renames):refs] if kind == "fsync-dir"]
    assert sorted(dir_syncs) == sorted(shards)  # once per shard, after the renames, before refs
    loaded = store.restore(store.find_exact(tokens).entry)
    assert loaded is not None
    store.close()


def test_failed_batch_rename_leaves_no_tmp_and_nothing_referenced(tmp_path: Path) -> None:
    fs = FaultyFileLayer()
    store = _open(tmp_path, fs)
    kept = tuple(range(1, 12))
    kept_caches = make_caches("llama", kept)
    assert store.store(kept, kept_caches)
    fs.fail("replace", nth=3, err=errno.EIO)  # the third rename of the batch
    new = tuple(range(100, 140))
    assert store.store(new, make_caches("llama", new)) is False
    assert fs.fired
    tmp = [p for p in (store.directory / "blobs").rglob("*") if p.name.endswith(".tmp")]
    assert tmp == []
    assert store.find_exact(new) is None
    report = store.check()
    assert report.clean or not report.dangling
    loaded = store.restore(store.find_exact(kept).entry)
    assert loaded is not None
    assert tuple(live_bits(c) for c in loaded.caches) == tuple(live_bits(c) for c in kept_caches)
    names = {p.name for p in (store.directory / "blobs").rglob("*") if p.is_file()}
    assert all(is_block_name(n) for n in names)
    store.close()
    assert os.path.isdir(tmp_path)


def test_every_shard_is_made_at_creation_and_a_full_disk_does_not_stop_an_open(tmp_path: Path) -> None:
    """A store's first block in a shard pays no mkdir and no fsync of blobs/ on its
    write path: all 256 shards exist, made durable by one fsync, once the directory
    is created. A disk too full for them still opens (they are made on first use)."""
    fs = OrderLog()
    store = _open(tmp_path / "a", fs)
    blobs = store.directory / "blobs"
    assert sorted(p.name for p in blobs.iterdir()) == [f"{i:02x}" for i in range(256)]
    assert [e for e in fs.events if e == ("fsync-dir", str(blobs))] == [("fsync-dir", str(blobs))]
    store.close()

    class NoRoomForShards(FileLayer):
        def mkdir(self, path: Path) -> None:
            if path.parent.name == "blobs":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            super().mkdir(path)

    with _open(tmp_path / "b", NoRoomForShards()) as full:
        assert not any((full.directory / "blobs").iterdir())
        tokens = tuple(range(1, 12))
        assert full.store(tokens, make_caches("llama", tokens)) is False  # no shard for its blocks
        assert len(full) == 0
