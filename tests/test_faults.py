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
            fs.write(fd, b"0123456789")
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
