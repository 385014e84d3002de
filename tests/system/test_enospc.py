"""Real full disks: a small tmpfs and a loop-mounted ext4 image, filled for real.

No injected errno here (tests/test_faults.py does that through the FileLayer
seam): the kernel says ENOSPC wherever it runs out — a block's write, a
header's, LMDB's pages. Each case fills the filesystem leaving a gap of a few
bytes to a few blocks, stores until a store is refused, then checks what the
store promises: ``store()`` returns False with one warning, every entry
acknowledged before is found and restores bit-exact, no temp file is left
behind (only finished blocks nothing references, which ``gc`` reclaims), and
storing resumes once space is freed.

Mounting needs root on Linux. Where it is not permitted the test skips with
the reason; ``.ci/run`` sets ``BLOCKKV_REQUIRE_MOUNT=1``, which turns that skip
into a failure, so CI always runs these on real filesystems.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockkv.format.layout import is_block_name
from blockkv.store import BlockStore
from blockkv.testing.stateful import live_bits
from blockkv.testing.strategies import make_caches

SIZES = {"tmpfs": 2 << 20, "ext4": 8 << 20}  # small enough to fill in a moment
BLOCK_TOKENS = 16  # an entry spans several blocks, so a disk can fill mid-store


def _unavailable(reason: str) -> None:
    if os.environ.get("BLOCKKV_REQUIRE_MOUNT") == "1":
        pytest.fail(f"cannot mount a real filesystem: {reason} (BLOCKKV_REQUIRE_MOUNT=1 forbids skipping)")
    pytest.skip(f"cannot mount a real filesystem: {reason}")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted, nearly empty filesystem of a few MiB; unmounted in teardown."""
    kind: str = request.param
    if not sys.platform.startswith("linux"):
        _unavailable(f"mount(8) of {kind} is Linux-only here ({sys.platform})")
    if os.geteuid() != 0:
        _unavailable(f"mounting {kind} needs root (euid {os.geteuid()})")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={SIZES[kind]},mode=0700", "tmpfs", str(mnt)]
    else:
        if shutil.which("mkfs.ext4") is None:
            _unavailable("mkfs.ext4 not installed (e2fsprogs)")
        image = tmp_path / "disk.img"
        with open(image, "wb") as f:
            f.truncate(SIZES[kind])
        made = _run("mkfs.ext4", "-q", "-F", str(image))
        if made.returncode:
            _unavailable(f"mkfs.ext4 failed: {made.stderr.strip()}")
        cmd = ["mount", "-o", "loop", str(image), str(mnt)]
    mounted = _run(*cmd)
    if mounted.returncode:
        _unavailable(f"{' '.join(cmd)}: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mnt
    finally:
        if _run("umount", str(mnt)).returncode:
            _run("umount", "-l", str(mnt))  # something still holds it: detach, never leave it mounted


def _fill(mnt: Path, gap: int) -> Path:
    """Write a filler file until the kernel says ENOSPC, then give back ``gap`` bytes."""
    filler = mnt / "filler"
    chunk = b"\xa5" * (64 << 10)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = 0
        while chunk:
            try:
                size += os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                chunk = chunk[: len(chunk) // 2]  # top up the last partial extent
        os.ftruncate(fd, max(0, size - gap))
        os.fsync(fd)
    finally:
        os.close(fd)
    return filler


def _files(root: Path) -> set[str]:
    """Every file under ``root`` except the LMDB environment's (its pages are
    LMDB's business). Directories do not count: an empty shard directory made
    before the disk filled is harmless and reused."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel.name == "index":
            dirnames.clear()
            continue
        out.update(str(rel / n) for n in filenames)
    return out


def _prompt(i: int) -> tuple[int, ...]:
    """Distinct prompts sharing a system prefix (so stores mix dedup hits and new blocks)."""
    return tuple(range(1, 17)) + tuple((i * 7 + j) % 256 for j in range(40))


def _open(root: Path) -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint="fp-enospc", tokenizer_hash="tok",
                      max_bytes=1 << 40, block_tokens=BLOCK_TOKENS, gc_grace=0.0)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "blockkv" and r.levelno >= logging.WARNING]


def _assert_restores(store: BlockStore, kept: dict[tuple[int, ...], tuple]) -> None:
    for tokens, bits in kept.items():
        m = store.find_exact(tokens)
        assert m is not None, f"acknowledged entry of {len(tokens)} tokens lost"
        loaded = store.restore(m.entry)
        assert loaded is not None and tuple(live_bits(c) for c in loaded.caches) == bits


@pytest.mark.parametrize("gap", [0, 3000, 40_000])
def test_full_disk_refuses_loses_nothing_and_resumes(small_fs: Path, gap: int,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    root = small_fs / "cache"
    store = _open(root)
    kept: dict[tuple[int, ...], tuple] = {}
    for i in range(2):  # acknowledged while the disk had room
        caches = make_caches("llama", _prompt(i))
        assert store.store(_prompt(i), caches)
        kept[_prompt(i)] = tuple(live_bits(c) for c in caches)
    filler = _fill(small_fs, gap)
    before = _files(root)
    with caplog.at_level(logging.WARNING, logger="blockkv"):
        i = len(kept)
        while True:  # a gap may still hold an entry or two: store until the disk refuses one
            assert i < 40, "the disk never filled"
            caches = make_caches("llama", _prompt(i))
            ok = store.store(_prompt(i), caches)
            if not ok:
                break
            kept[_prompt(i)] = tuple(live_bits(c) for c in caches)
            before = _files(root)
            i += 1
        for j in range(i + 1, i + 3):  # still full: refused again, without a second warning
            assert store.store(_prompt(j), make_caches("llama", _prompt(j))) is False
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
    leftovers = _files(root) - before
    # a refused store may leave blocks it published (refcount 0, gc's to reclaim), never a temp file
    assert all(is_block_name(Path(f).name) and "/blobs/" in f for f in leftovers), leftovers
    _assert_restores(store, kept)  # served while the disk is still full

    filler.unlink()  # space freed: gc reclaims the refused stores' blocks, storing resumes
    store.gc()
    assert not _files(root) & leftovers
    caches = make_caches("llama", _prompt(99))
    assert store.store(_prompt(99), caches)
    kept[_prompt(99)] = tuple(live_bits(c) for c in caches)
    _assert_restores(store, kept)
    store.close()

    with _open(root) as reopened:  # and all of it is on disk, not just in this handle
        _assert_restores(reopened, kept)
        reopened.check(repair=True)
        report = reopened.check()
        assert report.clean, report.to_json()
        assert len(reopened) == len(kept)


def test_open_on_a_full_disk_serves_what_is_there(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A restart while the disk is full: open recovers, finds and restores every entry."""
    root = small_fs / "cache"
    with _open(root) as store:
        caches = make_caches("llama", _prompt(0))
        assert store.store(_prompt(0), caches)
    _fill(small_fs, 0)
    with caplog.at_level(logging.WARNING, logger="blockkv"), _open(root) as store:
        _assert_restores(store, {_prompt(0): tuple(live_bits(c) for c in caches)})
        assert store.store(_prompt(1), make_caches("llama", _prompt(1))) is False
        assert len(_warnings(caplog)) == 1, _warnings(caplog)


def test_ci_turns_a_mount_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOCKKV_REQUIRE_MOUNT", raising=False)
    with pytest.raises(pytest.skip.Exception):
        _unavailable("no permission")
    monkeypatch.setenv("BLOCKKV_REQUIRE_MOUNT", "1")
    with pytest.raises(pytest.fail.Exception, match="no permission"):
        _unavailable("no permission")
