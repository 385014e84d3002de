"""Power-loss crash states (the full run is ``python tools/powerloss.py``).

First the model itself, on plain files: what survives a cut is what was
fsynced (data) and dir-fsynced (names), everything else may be lost, torn or
undone. Then the store: every crash point of the small workloads and a
sample of a longer one (``tools/powerloss.py --quick``), and proof that the
checks bite — a store that forgot an fsync loses acknowledged entries here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import stat
import sys
from pathlib import Path

import pytest

from blockkv.local.index import SETTLED
from blockkv.testing.powerloss import RecordingFileLayer

_PATH = Path(__file__).resolve().parents[2] / "tools" / "powerloss.py"
_spec = importlib.util.spec_from_file_location("powerloss_tool", _PATH)
assert _spec and _spec.loader
tool = importlib.util.module_from_spec(_spec)
sys.modules["powerloss_tool"] = tool
_spec.loader.exec_module(tool)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _outcomes(rec: RecordingFileLayer, tmp: Path) -> list[tuple[int, dict[str, bytes], set[str]]]:
    """(cut, files, directories) of every state of every crash point, every name subset included."""
    out = []
    rng = random.Random(0)
    for point in rec.crash_points():
        for n, state in enumerate(rec.states(point, rng, n_random=6, exhaustive_upto=6)):
            dest = tmp / f"s-{point.ops}-{point.lmdb_version}-{n}"
            rec.materialize(state, dest)
            dirs = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_dir()}
            out.append((point.ops, _tree(dest), dirs))
    return out


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    (root / "old").write_bytes(b"old bytes")
    return root


def test_fsync_then_rename_then_dir_fsync_is_all_or_nothing(tmp_path: Path) -> None:
    root = _root(tmp_path)
    rec = RecordingFileLayer(root, tmp_path / "base")
    body = bytes(range(256)) * 40
    rec.write_atomic(root / "new", [body])  # create tmp, write, fsync, rename, fsync dir
    rec.unlink(root / "old")  # its directory is never fsynced again
    rec.finish()
    assert [op.kind for op in rec.log] == ["create", "write", "fsync", "rename", "fsync_dir", "unlink"]
    outcomes = _outcomes(rec, tmp_path / "states")
    end = len(rec.log)
    assert all(files.get("new", body) == body for _, files, _ in outcomes), "a renamed file was torn"
    assert all(files.get("new") == body for cut, files, _ in outcomes if cut >= 5), "dir-fsynced rename undone"
    assert {"new" in files for cut, files, _ in outcomes if cut == 4} == {True, False}  # rename not yet durable
    finals = [files for cut, files, _ in outcomes if cut == end]
    assert {"old" in files for files in finals} == {True, False}  # an un-synced unlink may be undone
    # between the write and the fsync the tmp file's bytes may be anything the model allows
    tmp_bodies = {b for cut, files, _ in outcomes if cut == 2 for n, b in files.items() if n not in ("new", "old")}
    assert body in tmp_bodies and any(b != body for b in tmp_bodies)


def test_a_layer_that_forgets_fsync_tears_renamed_files(tmp_path: Path) -> None:
    class ForgetsFsync(RecordingFileLayer):
        def fsync(self, fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                super().fsync(fd)

    root = _root(tmp_path)
    rec = ForgetsFsync(root, tmp_path / "base")
    rec.write_atomic(root / "new", [b"x" * 5000])
    rec.finish()
    finals = [files for cut, files, _ in _outcomes(rec, tmp_path / "states") if cut == len(rec.log)]
    assert any(files.get("new") != b"x" * 5000 for files in finals)


def test_an_undone_mkdir_takes_its_subtree(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "sub").mkdir()
    rec = RecordingFileLayer(root, tmp_path / "base")
    rec.mkdir(root / "d")  # the root is never fsynced: the name "d" may vanish
    rec.write_atomic(root / "d" / "f", [b"in d"])  # durable inside d
    rec.makedirs(root / "sub" / "e" / "g")  # makedirs fsyncs each parent: always there
    rec.finish()
    finals = [(files, dirs) for cut, files, dirs in _outcomes(rec, tmp_path / "states") if cut == len(rec.log)]
    assert {"d" in dirs for _, dirs in finals} == {True, False}
    assert all(files.get("d/f") == b"in d" for files, dirs in finals if "d" in dirs)
    assert all("sub/e/g" in dirs for _, dirs in finals)


def test_crash_points_split_at_index_commits(tmp_path: Path) -> None:
    """A store's LMDB commits fall between file operations: both sides are crash points."""
    work = tmp_path / "w"
    (work / "live").mkdir(parents=True)
    driver = tool.Driver(work / "live", work / "base")
    tool.w_dedup_store(driver)
    rec = driver.finish()
    points = rec.crash_points()
    assert len(points) > len(rec.log) + 1  # take_refs happened between two file operations
    assert len({p.lmdb_version for p in points}) >= 2


def test_every_crash_point_of_the_small_workloads(tmp_path: Path) -> None:
    fig = tool.run(tmp_path, quick=True, seed=0, long_runs=1, long_steps=8, sample=8)
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
    assert fig.workloads == len(tool.SMALL) + 1
    assert fig.states >= fig.crash_points > fig.workloads
    assert fig.verified > 0 and fig.successions > 0 and fig.extra > 0


@pytest.mark.parametrize("forgets", ["file fsync", "directory fsync"])
def test_a_store_that_forgets_a_barrier_is_caught(tmp_path: Path, forgets: str) -> None:
    """The same checks on a store whose file layer skips one kind of barrier must find lost entries."""

    class Forgetful(RecordingFileLayer):
        def fsync(self, fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode) == (forgets == "directory fsync"):
                return
            super().fsync(fd)

    fig = tool.Figures()
    tool.run_workload("store", tool.w_store, tmp_path / "w", fig, random.Random(0), sample=None,
                      n_random=0, exhaustive_upto=0, fs_class=Forgetful)
    assert fig.lost > 0, fig.line()


def test_index_forms_are_what_the_store_sees(tmp_path: Path) -> None:
    """"lost" makes the store rebuild from the files; "previous-boot" does too
    until the closing handle settled the index (synced it, then wrote
    ``index.settled``), and is trusted after; "synced" is trusted."""
    work = tmp_path / "w"
    (work / "live").mkdir(parents=True)
    driver = tool.Driver(work / "live", work / "base")
    tool.w_dedup_store(driver)
    rec = driver.finish()
    settled_at = max(i for i, op in enumerate(rec.log) if op.kind == "rename" and op.dst.endswith(SETTLED))
    points = rec.crash_points()
    dirty = max((p for p in points if p.ops <= settled_at), key=lambda p: (p.ops, p.lmdb_version))
    for point, settled in ((dirty, False), (points[-1], True)):
        for state in rec.states(point, random.Random(0), n_random=0):
            for form in ("lost", "previous-boot", "synced"):
                dest = tmp_path / f"{point.ops}-{state.label}-{form}"
                rec.materialize(dataclasses.replace(state, index=form), dest)
                with tool.BlockStore(dest, **tool.PARAMS) as store:
                    rebuilt = any("rebuilt" in note for note in store.recovery)
                    expected = form == "lost" or (form == "previous-boot" and not settled)
                    assert rebuilt == expected, (point, settled, form, store.recovery)
                    assert len(store) == 2


def test_replaying_the_whole_log_gives_the_live_directory(tmp_path: Path) -> None:
    """The recorder misses nothing the store wrote: the final "everything landed"
    state holds exactly the live directory's headers and blocks, byte for byte."""
    work = tmp_path / "w"
    (work / "live").mkdir(parents=True)
    driver = tool.Driver(work / "live", work / "base")
    tool.w_supersede(driver)
    rec = driver.finish()
    point = rec.crash_points()[-1]
    done = next(s for s in rec.states(point, random.Random(0), n_random=0) if s.label == "process crash")
    rec.materialize(done, tmp_path / "replayed")

    def files(root: Path) -> dict[str, bytes]:
        return {k: v for k, v in _tree(root).items() if "/entries/" in k or "/blobs/" in k}

    assert files(tmp_path / "replayed") == files(work / "live")
    assert len(files(work / "live")) > 5


def test_a_rename_between_directories_is_durable_at_its_target_first(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "a").mkdir()
    (root / "b").mkdir()
    (root / "a" / "f").write_bytes(b"moved")
    rec = RecordingFileLayer(root, tmp_path / "base")
    rec.replace(root / "a" / "f", root / "b" / "f")
    rec.fsync_dir(root / "b")  # the target only
    rec.finish()
    finals = [files for cut, files, _ in _outcomes(rec, tmp_path / "states") if cut == len(rec.log)]
    assert all(files.get("b/f") == b"moved" for files in finals)
    assert {"a/f" in files for files in finals} == {True, False}
