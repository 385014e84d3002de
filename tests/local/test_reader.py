"""blockkv.local.reader: the read-only view ``ls`` and ``stats`` use agrees with what a
store opened on the same directory serves, with its index trusted or lost."""

from __future__ import annotations

import shutil
from pathlib import Path

from blockkv import BlockStore, list_fingerprints
from blockkv.local.catalog import footprint
from blockkv.local.reader import read_directory
from blockkv.testing.models import prefill, random_tokens, tiny_model


def _facts(entries: list) -> dict[str, tuple]:
    return {e.id: (e.ns, e.tokens, e.nbytes, e.header_bytes, e.blocks, e.trimmable) for e in entries}


def test_the_view_matches_the_store_with_and_without_an_index(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    model = tiny_model("llama")
    base = random_tokens(80, seed=1)
    with BlockStore(root, model_id="m", config_fingerprint="fp", tokenizer_hash="t",
                    max_bytes=1 << 30, block_tokens=16) as store:
        for i, ns in enumerate(["", "a", "b"]):
            tokens = base + random_tokens(20 + i, seed=10 + i)
            assert store.store(tokens, prefill(model, tokens)[0], ns=ns)
    (fp,) = list_fingerprints(root)
    with BlockStore.open_dir(fp.path, gc_grace=float("inf"), tmp_grace=float("inf")) as store:
        expected, disk, blocks = store.entries(), store.total_bytes, store.block_count  # as reopened

    trusted = read_directory(fp.path)
    assert trusted.index_used and _facts(trusted.entries) == _facts(expected)
    assert {e.id: e.last_use for e in trusted.entries} == {e.id: e.last_use for e in expected}
    assert (footprint(trusted.entries, trusted.block_sizes), trusted.blocks, trusted.logical_bytes) == (
        disk, blocks, sum(e.nbytes for e in expected))

    shutil.rmtree(fp.path / "index")
    lost = read_directory(fp.path)
    assert not lost.index_used and not (fp.path / "index").exists()
    assert _facts(lost.entries) == _facts(expected)
    assert (footprint(lost.entries, lost.block_sizes), lost.blocks) == (disk, blocks)
    # without an index, a header's write time is its last use, as for a store rebuilding one
    assert {e.id: e.last_use for e in lost.entries} == {
        e.id: next((fp.path / "entries").rglob(f"{e.id}.bkv")).stat().st_mtime for e in lost.entries
    }
