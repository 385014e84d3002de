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
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.powerloss import RecordingFileLayer
from tool_scripts import load

IDENT = dict(model_id="m", config_fingerprint="fp-darwin", tokenizer_hash="t", max_bytes=1 << 30)


class DarwinBarriers(FileLayer):
    """macOS's barrier path, recording (barrier, file or dir) per call;
    ``fail_at``: the n-th flush (1-based, full or plain) fails with EIO.
    ``steps`` also logs renames and crash points, for the order."""

    platform = "darwin"

    def __init__(self, fail_at: int = 0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.steps: list[str] = []
        self.fail_at = fail_at

    def replace(self, src: Path, dst: Path) -> None:
        self.steps.append("rename")
        super().replace(src, dst)

    def crash_point(self, name: str) -> None:
        self.steps.append(name)

    @staticmethod
    def _kind(fd: int) -> str:
        return "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

    def full_fsync(self, fd: int) -> None:
        self.calls.append(("F_FULLFSYNC", self._kind(fd)))
        self.steps.append("F_FULLFSYNC")
        if len(self.calls) == self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)  # Linux has no F_FULLFSYNC: the nearest real flush

    def plain_fsync(self, fd: int) -> None:
        self.calls.append(("fsync", self._kind(fd)))
        self.steps.append("fsync")
        if len(self.calls) == self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)


class LinuxBarriers(FileLayer):
    """Linux's barrier path (every fsync a barrier), counted by file or dir."""

    platform = "linux"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def plain_fsync(self, fd: int) -> None:
        self.calls.append(("fsync", DarwinBarriers._kind(fd)))
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


def counts(calls: list[tuple[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for barrier, kind in calls:
        out[f"{barrier} {kind}"] = out.get(f"{barrier} {kind}", 0) + 1
    return out


def store_counting(fs: Any, root: Path, prompts: Any) -> list[dict[str, int]]:
    """The flushes of a fresh 1024-token store (4 blocks of 256 tokens) and of
    its +512 continuation (2 new blocks; it supersedes the first entry)."""
    per_store = []
    with BlockStore(root, fs=fs, **IDENT) as store:
        for tokens, caches in prompts:
            before = len(fs.calls)
            assert store.store(tokens, caches)
            per_store.append(counts(fs.calls[before:]))
    return per_store


def test_barriers_per_store_on_linux(tmp_path: Path, prompts: Any) -> None:
    """Pinned (docs/design.md, "Barriers per store", says why each is needed):
    a fresh store fsyncs its 4 block files and its header file, the 4 shard
    directories and the header's directory; a continuation its 2 new blocks
    and its header, their 2 shards and the header's directory, and that
    directory again for the superseded entry's header it removes."""
    fresh, continuation = store_counting(LinuxBarriers(), tmp_path, prompts)
    assert fresh == {"fsync file": 5, "fsync dir": 5}
    assert continuation == {"fsync file": 3, "fsync dir": 4}


def test_barriers_per_store_on_darwin(tmp_path: Path, prompts: Any) -> None:
    """On macOS a batch of blocks pays two drive flushes (their data, then
    their names), not two per block: the files and all directories but the
    last get a plain fsync; the header keeps its own two."""
    fresh, continuation = store_counting(DarwinBarriers(), tmp_path, prompts)
    assert fresh == {"fsync file": 4, "fsync dir": 3, "F_FULLFSYNC file": 1, "F_FULLFSYNC dir": 3}
    assert continuation == {"fsync file": 2, "fsync dir": 1, "F_FULLFSYNC file": 1, "F_FULLFSYNC dir": 4}


def test_on_darwin_no_plain_fsync_stands_unflushed_before_the_next_step(tmp_path: Path, prompts: Any) -> None:
    """Every rename and every step of the write order comes after a full
    flush that follows the last plain fsync: what a plain fsync left in the
    drive's cache is on the medium before anything depends on it."""
    fs = DarwinBarriers()
    store_counting(fs, tmp_path, prompts)
    unflushed = False
    for step in fs.steps:
        if step == "fsync":
            unflushed = True
        elif step == "F_FULLFSYNC":
            unflushed = False
        else:
            assert not unflushed, f"{step} with a plain fsync not yet flushed: {fs.steps}"
    assert not unflushed


def test_a_filesystem_without_full_fsync_gets_a_plain_one(tmp_path: Path) -> None:
    class Unsupported(DarwinBarriers):
        def full_fsync(self, fd: int) -> None:
            self.calls.append(("F_FULLFSYNC", self._kind(fd)))
            raise OSError(errno.ENOTSUP, "Operation not supported")

    fs = Unsupported()
    fs.write_atomic(tmp_path / "f", [b"x"])
    assert fs.calls == [("F_FULLFSYNC", "file"), ("fsync", "file"), ("F_FULLFSYNC", "dir"), ("fsync", "dir")]


def test_an_eio_from_any_flush_is_not_stored(tmp_path: Path, prompts: Any) -> None:
    """Each flush of a store in turn (full or plain) fails with EIO: the store returns
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


# -- the power-loss model of macOS's barriers (blockkv.testing.powerloss, platform "darwin") --

powerloss_tool = load("powerloss")


def test_the_darwin_barrier_path_loses_nothing_at_any_crash_point(tmp_path: Path) -> None:
    """Every crash point of a store and its superseding continuation (one
    state each, taken in turn: the quick form), with plain fsyncs modelled as
    the drive's cache: no acknowledged entry lost, nothing restores wrong
    (``tools/powerloss.py --platform darwin`` runs every workload)."""
    fig = powerloss_tool.Figures()
    powerloss_tool.run_workload("supersede", powerloss_tool.w_supersede, tmp_path / "w", fig, random.Random(0),
                                sample=None, n_random=1, exhaustive_upto=0, per_point=1, platform="darwin")
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
    assert fig.verified > 0 and fig.successions > 0


def test_a_darwin_store_without_its_full_flushes_is_caught(tmp_path: Path) -> None:
    """The model bites: where every flush is a plain fsync, entries are lost."""

    class PlainOnly(RecordingFileLayer):
        def full_fsync(self, fd: int) -> None:
            self.plain_fsync(fd)

    work = tmp_path / "w"
    (work / "live").mkdir(parents=True)
    driver = powerloss_tool.Driver(work / "live", work / "base", PlainOnly, "darwin")
    powerloss_tool.w_store(driver)
    rec = driver.finish()
    end = rec.crash_points()[-1]  # the store acknowledged; only plain fsyncs since the base
    nothing_unsynced = rec.states(end, random.Random(0), n_random=0)[0]
    rec.materialize(nothing_unsynced, tmp_path / "cut")
    fig = powerloss_tool.Figures()
    powerloss_tool.check_state(tmp_path / "cut", nothing_unsynced, driver.journal, fig, "end")
    assert fig.lost > 0, fig.line()


def test_a_plain_fsync_is_durable_only_once_a_full_one_follows(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    rec = RecordingFileLayer(root, tmp_path / "base", platform="darwin")
    tmp, _ = rec.write_tmp(root / "a", [b"a" * 5000], batched=True)  # plain fsync: in the drive's cache
    unflushed = len(rec.log)
    rec.fsync_dir(root)  # F_FULLFSYNC: flushes the cache, the tmp file's bytes with it
    rec.finish()
    assert [(op.kind, op.cached) for op in rec.log] == [
        ("create", False), ("write", False), ("fsync", True), ("fsync_dir", False)]
    assert rec.uncertain(unflushed).writes == [1]
    assert rec.uncertain(len(rec.log)).writes == []
    assert tmp.name.endswith(".tmp")
