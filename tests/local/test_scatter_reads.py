"""``FileLayer.read_exact``, the one read of a block file a restore makes:
scatter reads in runs, each run handed on whole, and a short read finished
or refused, never trusted."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from blockkv.fs import _READ_RUN, FileLayer, _read_rest


def _buffers(sizes: Sequence[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_buffers_are_filled_in_order_and_each_run_is_handed_on_once(tmp_path: Path) -> None:
    sizes = [7, 0, _READ_RUN // 2, _READ_RUN, 0, 3, _READ_RUN // 3 + 1]
    data = np.random.default_rng(1).integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    path = tmp_path / "block"
    path.write_bytes(data)
    buffers, runs = _buffers(sizes), []
    assert FileLayer().read_exact(path, buffers, runs.append)
    assert b"".join(bytes(b) for b in buffers) == data
    assert [b for run in runs for b in run] == buffers  # every buffer in exactly one run, in order
    assert len(runs) > 1


def test_a_file_of_another_length_fills_nothing(tmp_path: Path) -> None:
    path = tmp_path / "block"
    path.write_bytes(b"x" * 10)
    buffers, runs = _buffers([4, 5]), []
    assert not FileLayer().read_exact(path, buffers, runs.append)
    assert runs == [] and bytes(buffers[0]) == bytes(4)


def test_a_short_read_is_finished_from_where_it_stopped_or_refused_at_the_end(tmp_path: Path) -> None:
    data = bytes(range(100))
    path = tmp_path / "block"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        run = _buffers([0, 60, 40])
        run[1][:30] = data[:30]  # what the first, short read filled
        assert _read_rest(fd, run, 0, 30)
        assert bytes(run[1]) + bytes(run[2]) == data
        longer = _buffers([60, 50])  # the file ends 10 bytes before the run does
        assert not _read_rest(fd, longer, 0, 30)
    finally:
        os.close(fd)
