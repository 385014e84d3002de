"""Real flushes on macOS, run on Linux through the file layer's seam (issue #31).

A layer that says it is ``darwin`` runs macOS's barrier path: every file and
directory barrier must be ``F_FULLFSYNC`` (Linux has no such fcntl, so the
recording layer flushes with ``fsync`` where macOS would have used it), and
an I/O error from it must reach the store as "not stored": a fresh handle
finds nothing. Real stores of real caches from a tiny model.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp-darwin", tokenizer_hash="t", max_bytes=1 << 30)


class DarwinBarriers(FileLayer):
    """macOS's barrier path, recording (barrier, file or dir) per call;
    ``fail_at``: the n-th full flush (1-based) fails with EIO."""

    platform = "darwin"

    def __init__(self, fail_at: int = 0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_at = fail_at

    @staticmethod
    def _kind(fd: int) -> str:
        return "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

    def full_fsync(self, fd: int) -> None:
        self.calls.append(("F_FULLFSYNC", self._kind(fd)))
        if len(self.calls) == self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)  # Linux has no F_FULLFSYNC: the nearest real flush

    def plain_fsync(self, fd: int) -> None:
        self.calls.append(("fsync", self._kind(fd)))
        os.fsync(fd)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(model: Any) -> tuple[tuple[list[int], Any], tuple[list[int], Any]]:
    """A 1024-token prompt and its +512-token continuation, with their caches."""
    first = random_tokens(1024, seed=31)
    longer = first + random_tokens(512, seed=32)
    return (first, prefill(model, first)[0]), (longer, prefill(model, longer)[0])


def test_every_barrier_on_darwin_is_a_full_fsync(tmp_path: Path, prompts: Any) -> None:
    (first, caches), (longer, longer_caches) = prompts
    fs = DarwinBarriers()
    with BlockStore(tmp_path, fs=fs, **IDENT) as store:
        assert store.store(first, caches)
        assert store.store(longer, longer_caches)
    kinds = {kind for _, kind in fs.calls}
    assert kinds == {"file", "dir"}  # both kinds were flushed...
    assert {barrier for barrier, _ in fs.calls} == {"F_FULLFSYNC"}  # ...and every flush was a full one


def test_a_filesystem_without_full_fsync_gets_a_plain_one(tmp_path: Path) -> None:
    class Unsupported(DarwinBarriers):
        def full_fsync(self, fd: int) -> None:
            self.calls.append(("F_FULLFSYNC", self._kind(fd)))
            raise OSError(errno.ENOTSUP, "Operation not supported")

    fs = Unsupported()
    fs.write_atomic(tmp_path / "f", [b"x"])
    assert fs.calls == [("F_FULLFSYNC", "file"), ("fsync", "file"), ("F_FULLFSYNC", "dir"), ("fsync", "dir")]


def test_an_eio_from_full_fsync_is_not_stored(tmp_path: Path, prompts: Any) -> None:
    """Each barrier of a store in turn fails with EIO: the store returns
    False (never raises), and a fresh handle finds nothing it acknowledged.
    Before, the EIO fell back to a plain fsync and the store said True."""
    (first, caches), _ = prompts
    counted = DarwinBarriers()
    with BlockStore(tmp_path / "count", fs=counted, **IDENT) as store:
        opened = len(counted.calls)
        assert store.store(first, caches)
        barriers = len(counted.calls) - opened
    assert barriers > 0
    for n in range(1, barriers + 1):
        root = tmp_path / f"eio-{n}"
        fs = DarwinBarriers()
        with BlockStore(root, fs=fs, **IDENT) as store:
            fs.fail_at = len(fs.calls) + n
            assert store.store(first, caches) is False, f"barrier {n} of {barriers} failed and the store said True"
        with BlockStore(root, **IDENT) as fresh:
            assert fresh.find_exact(first) is None, f"barrier {n}: an entry whose flush failed is served"
