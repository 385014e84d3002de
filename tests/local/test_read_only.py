"""A root on a real read-only mount: ``BlockStore`` cannot open it (it must
write), ``ReadOnlyStore`` finds and restores from it bit for bit, and writes
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from blockkv import BlockStore, ReadOnlyStore
from blockkv.format.codec import encode_caches, walk_tensors
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(a writable root, the same root bind-mounted read-only); unmounted in teardown."""
    src, mnt = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        if os.environ.get("BLOCKKV_REQUIRE_MOUNT") == "1":
            pytest.fail("a read-only bind mount needs root on Linux (BLOCKKV_REQUIRE_MOUNT=1 forbids skipping)")
        pytest.skip("a read-only bind mount needs root on Linux")
    for cmd in (("mount", "--bind", str(src), str(mnt)), ("mount", "-o", "remount,bind,ro", str(mnt))):
        done = _run(*cmd)
        if done.returncode:
            _run("umount", str(mnt))
            pytest.fail(f"{' '.join(cmd)}: {done.stderr.strip()}")
    try:
        yield src, mnt
    finally:
        if _run("umount", str(mnt)).returncode:
            _run("umount", "-l", str(mnt))


def raw(caches: list) -> list[bytes | None]:
    """Every live tensor's raw bits, through the codec (the pre-allocated tail left out)."""
    return [None if t is None else np.asarray(t.data).tobytes() for t in walk_tensors(encode_caches(caches))]


IDENT = {"model_id": "tiny", "config_fingerprint": "ro", "tokenizer_hash": "t"}


def stored(root: Path, n: int, seed: int) -> tuple[list[int], list, str]:
    """(tokens, caches, entry id) of one entry of a real llama prefill stored under ``root``."""
    tokens = random_tokens(n, seed=seed)
    caches, _ = prefill(tiny_model("llama"), tokens)
    with BlockStore(root, max_bytes=1 << 30, block_tokens=64, **IDENT) as store:
        assert store.store(tokens, caches)
        return tokens, caches, store.find_exact(tokens).entry.id


def test_read_only_store_finds_and_restores_from_a_read_only_mount(read_only_view: tuple[Path, Path]) -> None:
    src, mnt = read_only_view
    tokens, caches, _ = stored(src, 300, seed=1)
    before = {p: p.stat().st_mtime_ns for p in src.rglob("*")}
    with pytest.raises(OSError) as refused:
        BlockStore(mnt, max_bytes=1 << 30, **IDENT)  # a writer needs to write
    assert "Read-only file system" in str(refused.value)
    with ReadOnlyStore(mnt, **IDENT) as reader:
        assert len(reader) == 1 and repr(reader).startswith("<ReadOnlyStore")
        match = reader.find(tokens[:200] + [1, 2])
        assert match is not None and match.prefix_len == 200
        loaded = reader.restore(match.entry, prefix_len=match.prefix_len)
        assert loaded is not None and loaded.tokens == tuple(tokens[:200])
        full = reader.restore(reader.find_exact(tokens).entry)
        assert raw(full.caches) == raw(caches)
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*")} == before  # nothing written, nothing touched


def test_a_failed_write_names_the_file_not_its_temporary(read_only_view: tuple[Path, Path]) -> None:
    _, mnt = read_only_view
    with pytest.raises(OSError) as refused:
        FileLayer().write_atomic(mnt / "entry.bkv", [b"bytes"])
    assert refused.value.filename == str(mnt / "entry.bkv") and ".tmp" not in str(refused.value)


def test_export_reads_a_read_only_mount_and_writes_nothing_under_it(read_only_view: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """``blockkv export`` needs no write access to the root: the file it writes
    loads in mlx-lm bit for bit, and the root is left as it was."""
    from mlx_lm.models.cache import load_prompt_cache

    src, mnt = read_only_view
    _, caches, entry_id = stored(src, 200, seed=2)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"") for p in src.rglob("*")}
    out = tmp_path / "out.safetensors"
    done = _run(sys.executable, "-m", "blockkv", "export", str(mnt), entry_id, "-o", str(out), "-f", "ro")
    assert done.returncode == 0, done.stderr
    assert raw(load_prompt_cache(str(out))) == raw(caches)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"") for p in src.rglob("*")} == before
