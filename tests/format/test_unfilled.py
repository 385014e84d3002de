"""Restores allocate their destination arrays without zeroing them (unfilled.py):
no byte of such an array is served unless a block wrote it, and the loader
mlx uses to allocate them never aborts a process at exit."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from blockkv.errors import CorruptHeaderError
from blockkv.format import unfilled
from blockkv.format.blocks import split_entry
from blockkv.format.codec import device_buffers
from blockkv.format.descriptor import validate_descriptor
from blockkv.format.rebuild import Target, rebuild
from blockkv.store import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.stateful import live_bits
from blockkv.testing.strategies import make_caches


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "bool", "complex64", "uint64"])
def test_device_buffers_are_writable_views_of_their_arrays(dtype: str) -> None:
    shapes = [(1, 2, 33, 8), (3,), (0, 4), ()]
    made = device_buffers([(dtype, s) for s in shapes])
    for (array, view), shape in zip(made, shapes):
        assert tuple(array.shape) == shape and view.shape == shape
        bits = np.random.default_rng(0).integers(0, 2, size=view.nbytes, dtype=np.uint8)
        view.reshape(-1).view(np.uint8)[:] = bits  # what a block read does
        assert np.array_equal(np.array(array.reshape(-1).view(mx.uint8)), bits)


def test_device_buffers_of_one_restore_share_no_byte() -> None:
    """One load makes every array of a restore: each must be its own memory,
    or filling one would overwrite another."""
    made = device_buffers([("bfloat16", (1, 4, 40, 8))] * 5 + [("int8", (7,)), ("complex64", (3, 2))])
    for k, (_, view) in enumerate(made):
        view.reshape(-1).view(np.uint8)[:] = k
    for k, (array, _) in enumerate(made):
        assert np.array_equal(np.array(array.reshape(-1).view(mx.uint8)), np.full(array.nbytes, k, np.uint8))


def test_a_fill_that_leaves_bytes_unwritten_serves_nothing() -> None:
    """A ``fill`` that stops short (here: the last block is never read) gets no
    arrays back: rebuild counts the bytes of the targets filled, per array."""
    model = tiny_model("llama", dtype=mx.bfloat16)
    caches, _ = prefill(model, random_tokens(300, seed=1), chunk=64)
    layout = split_entry(caches, block_tokens=64)
    desc = validate_descriptor(json.loads(json.dumps(layout.descriptor)))
    payload = {b.ref.name: b for b in layout.blocks}

    def fill_all_but_last(targets: Iterator[Target]) -> Iterator[Target]:
        for target in list(targets)[:-1]:
            block = payload[target.ref.name]
            target.scatter(b"".join(np.ascontiguousarray(p).tobytes() for p in block.parts))
            yield target

    with pytest.raises(CorruptHeaderError, match="cover every byte"):
        rebuild(desc, fill=fill_all_but_last)


_ALLOCATE_AND_EXIT = """
import numpy as np
from blockkv.format.codec import device_buffers
made = device_buffers([("bfloat16", (1, 8, 512, 64))] * 8)
for _, view in made:
    view[...] = 1
"""


def _exit_code(_: int) -> int:
    run = subprocess.run([sys.executable, "-c", _ALLOCATE_AND_EXIT], check=False, capture_output=True, timeout=120)
    return run.returncode


def test_processes_that_allocate_and_exit_at_once_exit_cleanly() -> None:
    """mlx drops its loader's stream on an I/O thread just after the load; a
    process exiting in that window aborted (2 of 40 without the wait in
    unfilled.py). 24 processes that allocate and exit at once all exit 0."""
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(_exit_code, range(24)))
    assert codes == [0] * 24


def test_an_mlx_that_refuses_the_stream_costs_zeroing_not_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Another mlx may not load an unfilled stream: restores then zero their
    arrays, still restore bit-exact, and the log says so once."""

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("[load] this mlx reads streams differently")

    monkeypatch.setattr(unfilled.mx, "load", refuse)
    monkeypatch.setattr(unfilled, "_refused", False)
    tokens = list(range(3, 140))
    caches = make_caches("llama", tokens)
    with BlockStore(tmp_path / "root", model_id="m", config_fingerprint="fp", tokenizer_hash="t",
                    max_bytes=1 << 30, block_tokens=32) as store:
        assert store.store(tokens, caches)
        entry = store.find_exact(tokens).entry
        with caplog.at_level(logging.WARNING, logger="blockkv"):
            for _ in range(2):
                loaded = store.restore(entry)
                assert loaded is not None
                assert [live_bits(c) for c in loaded.caches] == [live_bits(c) for c in caches]
    assert sum("did not load an unfilled stream" in r.getMessage() for r in caplog.records) == 1
