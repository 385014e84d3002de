"""Fault injection through the file-layer seam.

First the FaultyFileLayer itself (each fault fires exactly where armed), then
the store under each fault: a failed store returns False and warns once,
everything stored before is still found and restored bit-exact, and the
store keeps serving."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from blockkv.testing.faults import FaultyFileLayer, SimulatedCrash


def test_fault_fires_on_the_nth_call_only(tmp_path: Path) -> None:
    fs = FaultyFileLayer()
    fs.fail("fsync", nth=2, err=errno.EIO)
    fs.write_atomic(tmp_path / "a", [b"a"], sync_dir=False)  # fsync call 1
    with pytest.raises(OSError) as exc:
        fs.write_atomic(tmp_path / "b", [b"b"], sync_dir=False)
    assert exc.value.errno == errno.EIO
    fs.write_atomic(tmp_path / "c", [b"c"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]  # no tmp left behind
    assert fs.fired == ["fsync:EIO"] and not fs.armed


def test_torn_write_lands_half_then_fails(tmp_path: Path) -> None:
    fs = FaultyFileLayer()
    fs.tear()
    target = tmp_path / "t"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError):
            fs.write(fd, [b"0123456789"])
    finally:
        os.close(fd)
    assert target.read_bytes() == b"01234"


def test_persistent_fault_and_crash_point() -> None:
    fs = FaultyFileLayer()
    fs.fail("replace", times=2)
    for _ in range(2):
        with pytest.raises(OSError):
            fs.replace(Path("/nonexistent/a"), Path("/nonexistent/b"))
    assert not fs.armed
    fs.crash_at("store:refs-taken", nth=2)
    fs.crash_point("store:refs-taken")
    fs.crash_point("store:blocks-written")
    with pytest.raises(SimulatedCrash):
        fs.crash_point("store:refs-taken")
    with pytest.raises(ValueError):
        fs.crash_at("no:such-point")


# -- the store under each fault --------------------------------------------------

import logging  # noqa: E402

from blockkv.store import BlockStore  # noqa: E402
from blockkv.testing.stateful import live_bits  # noqa: E402
from blockkv.testing.strategies import make_caches  # noqa: E402


def _open(root: Path, fs: FaultyFileLayer, **kw: object) -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint="fp", tokenizer_hash="tok",
                      max_bytes=1 << 40, block_tokens=4, fs=fs, **kw)  # type: ignore[arg-type]


def _bits(caches: list) -> tuple:
    return tuple(live_bits(c) for c in caches)


@pytest.mark.parametrize("op", ["write", "fsync", "replace", "torn"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_failed_store_loses_nothing_and_keeps_serving(
    store_root: Path, op: str, err: int, nth: int, caplog: pytest.LogCaptureFixture
) -> None:
    fs = FaultyFileLayer()
    store = _open(store_root, fs)
    kept = {tuple(range(1, 12)): make_caches("llama", range(1, 12)), (7, 7, 7, 7, 7): make_caches("mamba", [7] * 5)}
    for tokens, caches in kept.items():
        assert store.store(tokens, caches)
    if op == "torn":
        fs.tear(nth, err)
    else:
        fs.fail(op, nth, err)  # type: ignore[arg-type]
    new = (1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9)  # shares blocks with a kept entry
    with caplog.at_level(logging.WARNING, logger="blockkv"):
        assert store.store(new, make_caches("llama", new)) is False
        assert fs.fired, "the fault never fired"
        assert store.store((2, 2, 2), make_caches("llama", (2, 2, 2))) is True  # keeps serving
    for tokens, caches in kept.items():
        m = store.find_exact(tokens)
        assert m is not None
        loaded = store.restore(m.entry)
        assert loaded is not None and _bits(loaded.caches) == _bits(caches)
    report = store.check()
    assert not report.dangling and all(idx >= truth for _, idx, truth in report.refcount_mismatches)
    store.close()


def test_lmdb_map_full_grows_and_succeeds(store_root: Path) -> None:
    """A deliberately tiny LMDB map: every store still lands."""
    store = _open(store_root, FaultyFileLayer(), index_map_size=96 << 10)
    prompts = [tuple(range(i, i + 40)) for i in range(0, 200, 10)]
    for tokens in prompts:
        assert store.store(tokens, make_caches("llama", tokens))
    assert all(store.find_exact(t) is not None for t in prompts)
    store.close()
