"""Only proof of corruption deletes; nothing from the root or the index is
trusted as a path or a size.

Transient faults enter through the store's own seam (a FileLayer subclass whose
``open_regular`` fails like a real EMFILE, EIO or MemoryError would), a real
EMFILE comes from lowering RLIMIT_NOFILE, and an mlx-lm failure from a
registered codec whose decode raises. Hostile files are real FIFOs, symlinks
and headers sealed with a valid checksum; the index is planted through its own
API. Victims outside the root must survive everything."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import struct
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from blockkv import BlockStore, NewerFormatError
from blockkv.format.codec import codec_for, register_codec
from blockkv.format.frame import frame_head
from blockkv.format.header import Header, decode_header, encode_header
from blockkv.fs import FileLayer
from blockkv.local.index import SETTLED, Index
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp", tokenizer_hash="t", max_bytes=1 << 30)
N = 40


class FlakyFiles(FileLayer):
    """Reads of paths containing ``match`` raise ``fault`` while it is set."""

    def __init__(self) -> None:
        self.fault: BaseException | None = None
        self.match = ""
        self.fired = 0

    def open_regular(self, path: Path) -> int:
        if self.fault is not None and self.match in str(path):
            self.fired += 1
            raise self.fault
        return super().open_regular(path)


@pytest.fixture(scope="module")
def stored() -> tuple[list[int], list[Any]]:
    tokens = random_tokens(N, seed=3)
    cache, _ = prefill(tiny_model("llama"), tokens)
    return tokens, cache


def _bits(caches: list[Any]) -> list[np.ndarray]:
    return [np.array(a.reshape(-1).view(mx.uint32)) for c in caches for a in (c.keys[..., :N, :], c.values[..., :N, :])]


def _assert_restores(s: BlockStore, tokens: list[int], cache: list[Any]) -> None:
    match = s.find_exact(tokens)
    assert match is not None
    loaded = s.restore(match.entry)
    assert loaded is not None
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_bits(loaded.caches), _bits(cache), strict=True))


def _files(directory: Path) -> list[str]:
    """The files of a directory but the index's (its tables and ``index.settled``)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and "index" not in p.parts and p.name != SETTLED)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- only proof of corruption deletes --------------------------------------------


@pytest.mark.parametrize(
    "match, fault",
    [
        (".bkv", OSError(errno.EMFILE, "Too many open files")),
        ("/blobs/", OSError(errno.EMFILE, "Too many open files")),
        ("/blobs/", OSError(errno.EIO, "Input/output error")),
        (".bkv", MemoryError()),
        ("/blobs/", MemoryError()),
    ],
    ids=["header-EMFILE", "block-EMFILE", "block-EIO", "header-MemoryError", "block-MemoryError"],
)
def test_transient_restore_failure_is_a_miss_that_keeps_the_entry(
    tmp_path: Path, stored: tuple[list[int], list[Any]], match: str, fault: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens, cache = stored
    fs = FlakyFiles()
    with BlockStore(tmp_path, fs=fs, **IDENT) as s:
        assert s.store(tokens, cache)
        before = _files(s.directory)
        fs.fault, fs.match = fault, match
        caplog.clear()
        for _ in range(2):
            assert s.restore(s.find_exact(tokens).entry) is None
        assert fs.fired >= 2
        assert len(_warnings(caplog)) == 1  # one warning, not one per failure
        assert _files(s.directory) == before  # header and blocks kept
        assert len(s) == 1 and s.find(tokens + [1]) is not None  # index row kept: no phantom either way
        fs.fault = None
        _assert_restores(s, tokens, cache)
    with BlockStore(tmp_path, **IDENT) as s:
        _assert_restores(s, tokens, cache)


def test_real_emfile_during_restore_keeps_the_entry(tmp_path: Path, stored: tuple[list[int], list[Any]]) -> None:
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        _assert_restores(s, tokens, cache)  # warm: nothing left to import lazily
        entry = s.find_exact(tokens).entry
        before = _files(s.directory)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))  # no new descriptor can be opened
        try:
            loaded = s.restore(entry)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert loaded is None
        assert _files(s.directory) == before
        _assert_restores(s, tokens, cache)


def test_exception_from_mlx_lm_from_state_is_a_miss(tmp_path: Path, stored: tuple[list[int], list[Any]]) -> None:
    tokens, cache = stored
    name, real = codec_for(KVCache())

    class SkewedCodec:
        """KVCache's codec, except that decoding fails as a newer mlx-lm's from_state might."""

        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        def decode(self, record: Any) -> Any:
            raise TypeError("from_state() takes 2 positional arguments but 4 were given")

    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        before = _files(s.directory)
        register_codec(KVCache, SkewedCodec(), name)
        try:
            assert s.restore(s.find_exact(tokens).entry) is None
        finally:
            register_codec(KVCache, real, name)
        assert _files(s.directory) == before and len(s) == 1
        _assert_restores(s, tokens, cache)


def test_unreadable_header_during_rebuild_check_and_gc_is_kept(
    tmp_path: Path, stored: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        directory = s.directory
    before = _files(directory)
    fs = FlakyFiles()
    fs.fault, fs.match = OSError(errno.EMFILE, "Too many open files"), ".bkv"
    with BlockStore(tmp_path, fs=fs, gc_grace=0.0, **IDENT) as s:
        s.rebuild_index()  # an index rebuild that cannot open the header
        assert len(s) == 0  # a miss for now...
        assert s.gc() == 0  # ...whose blocks no sweep may take
        report = s.check(repair=True)
        assert report.unreadable and not report.corrupt_headers and not report.orphan_blocks
        s.evict_to(0)
        assert _files(directory) == before  # nothing deleted
        fs.fault = None
        s.gc()  # readable again: indexed, and nothing to sweep
        assert len(s) == 1
        _assert_restores(s, tokens, cache)
        assert s.check().clean
    with BlockStore(tmp_path, **IDENT) as s:
        _assert_restores(s, tokens, cache)


def _with_version(data: bytes, version: int) -> bytes:
    """The same header framed as format ``version`` would frame it, resealed."""
    body = bytearray(data[:-32])
    struct.pack_into("<H", body, 8, version)
    return bytes(body) + blake3.blake3(bytes(body)).digest()


def test_header_of_a_newer_format_is_kept_and_its_blocks_are_not_swept(
    tmp_path: Path, stored: tuple[list[int], list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A newer blockkv sharing the root writes headers this one cannot parse:
    not proof of corruption, so never deleted, and its blocks never swept."""
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        entry = s.find_exact(tokens).entry
        (old,) = (s.directory / "entries").rglob("*.bkv")
        newer = old.with_name("0" * 32 + ".bkv")
        newer.write_bytes(_with_version(old.read_bytes(), 2))
        directory = s.directory
    with pytest.raises(NewerFormatError):
        decode_header(newer.read_bytes())
    with BlockStore(tmp_path, gc_grace=0.0, **IDENT) as s:
        s.rebuild_index()
        assert len(s) == 1 and s.find_exact(tokens).entry.id == entry.id  # the newer one is not served
        s.remove(s.find_exact(tokens).entry)  # its blocks are now referenced by the newer header alone
        s.gc()
        report = s.check(repair=True)
        assert report.newer_headers == [str(newer.relative_to(directory))]
        assert not report.corrupt_headers and not report.orphan_blocks and not report.clean
    assert newer.exists() and not old.exists()
    assert any("newer than this blockkv" in m for m in _warnings(caplog))
    # every block the newer header needs is still there: read at version 1, it restores bit-exact
    newer.write_bytes(_with_version(newer.read_bytes(), 1))
    with BlockStore(tmp_path, **IDENT) as s:
        s.rebuild_index()
        _assert_restores(s, tokens, cache)


def test_unreadable_block_during_check_is_not_corrupt(tmp_path: Path, stored: tuple[list[int], list[Any]]) -> None:
    tokens, cache = stored
    fs = FlakyFiles()
    with BlockStore(tmp_path, fs=fs, gc_grace=0.0, **IDENT) as s:
        assert s.store(tokens, cache)
        before = _files(s.directory)
        fs.fault, fs.match = OSError(errno.EIO, "Input/output error"), "/blobs/"
        report = s.check(repair=True)
        assert report.unreadable and not report.corrupt_blocks and not report.dangling and not report.orphan_blocks
        assert _files(s.directory) == before
        fs.fault = None
        assert s.check().clean
        _assert_restores(s, tokens, cache)


# -- nothing from the root or the index is trusted as a path or a size ------------


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_paths_planted_in_the_index_never_unlink_outside_the_root(
    tmp_path: Path, stored: tuple[list[int], list[Any]], kind: str
) -> None:
    tokens, cache = stored
    root = tmp_path / "root"
    victims = [tmp_path / "victim.txt", tmp_path / "pending-victim.txt", tmp_path / "absolute-victim.txt"]
    for v in victims:
        v.write_text("precious")
    with BlockStore(root, **IDENT) as s:
        assert s.store(tokens, cache)
        directory = s.directory
    index = Index(directory / "index")
    try:
        record = index.entries()[0]
        # the real entry's row names a file outside the root; so do two unfinished stores
        path = os.path.relpath(victims[0], directory) if kind == "relative" else str(victims[0])
        index.add_entry(replace(record, path=path), 0.0)
        index.take_refs("e" * 32, "../../pending-victim.txt", {})
        index.take_refs("d" * 32, str(victims[2]), {})
    finally:
        index.close()
    with BlockStore(root, **IDENT) as s:  # recovery rolls the pending records back
        entry = s.find_exact(tokens).entry
        s.remove(entry)
        assert s.find_exact(tokens) is None and not list((directory / "entries").rglob("*.bkv"))
        s.check(repair=True)
        s.rebuild_index()
        assert len(s) == 0
    for v in victims:
        assert v.read_text() == "precious"


def _header(s: BlockStore) -> Path:
    return next((s.directory / "entries").rglob("*.bkv"))


def _block(s: BlockStore) -> Path:
    return next(p for p in (s.directory / "blobs").rglob("*") if p.is_file())


def _restore_within(s: BlockStore, tokens: list[int], seconds: float = 20.0) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(s.restore(s.find_exact(tokens).entry)), daemon=True)
    t.start()
    t.join(seconds)
    return t, out


@pytest.mark.parametrize("which", ["header", "block"])
def test_fifo_in_place_of_a_file_does_not_hang_restore(
    tmp_path: Path, stored: tuple[list[int], list[Any]], which: str
) -> None:
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        target = _header(s) if which == "header" else _block(s)
        target.unlink()
        os.mkfifo(target, 0o600)
        t, out = _restore_within(s, tokens)
        hung = t.is_alive()
        if hung:  # let the blocked reader go before failing
            os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
            t.join(10)
        assert not hung, "restore blocked on a FIFO"
        assert out == [None]
        s.check(repair=True)  # and neither do check and repair
        s.gc()


_MEASURE = textwrap.dedent("""
    import json, os, resource, sys
    from blockkv import BlockStore, NewerFormatError, ReadOnlyStore
    root, ident, to_zero, read_only = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    if read_only:
        del ident["max_bytes"]
    with (ReadOnlyStore if read_only else BlockStore)(root, **ident) as s:
        entry = s.entries()[0]
        if to_zero:  # replaced while the store is open: its entry is indexed
            os.unlink(to_zero)
            os.symlink("/dev/zero", to_zero)
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        # a safety net only: today's bug must fail this test, not exhaust the machine
        resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 29), resource.RLIM_INFINITY))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        loaded = s.restore(entry)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_kib": after - before, "restored": loaded is not None}))
""")


def _restore_growth(root: Path, to_zero: Path | None = None, read_only: bool = False) -> dict[str, Any]:
    """Peak RSS growth of a restore in a fresh process (``to_zero``: a file to
    replace with a symlink to /dev/zero once the store is open; ``read_only``:
    by a ``ReadOnlyStore``)."""
    argv = [sys.executable, "-c", _MEASURE, str(root), json.dumps(IDENT), str(to_zero or ""), "1" if read_only else ""]
    out = subprocess.run(argv, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures VmSize from /proc (Linux)")
def test_header_symlinked_to_dev_zero_is_not_read(tmp_path: Path, stored: tuple[list[int], list[Any]]) -> None:
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        header = _header(s)
    result = _restore_growth(tmp_path, to_zero=header)
    assert not result["restored"]
    assert result["grew_kib"] < 128 << 10, result


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures VmSize from /proc (Linux)")
def test_tiny_header_declaring_a_huge_block_allocates_nothing_of_that_size(
    tmp_path: Path, stored: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache, attachments={"a": mx.zeros((1, 4))})
        header_path = _header(s)
    header = decode_header(header_path.read_bytes())
    descriptor = json.loads(json.dumps(header.descriptor))
    huge = 1 << 27  # float32 elements: a 512 MiB state block, declared by a ~1 KiB header
    descriptor["attachments"]["a"]["shape"] = [1, huge]
    descriptor["state_blocks"][0][1] = 4 * huge
    header_path.write_bytes(encode_header(Header(header.identity, header.ns, header.tokens, descriptor)))
    result = _restore_growth(tmp_path)
    assert not result["restored"]
    assert result["grew_kib"] < 128 << 10, result  # the block file is ~100 bytes: so is the read


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures VmSize from /proc (Linux)")
@pytest.mark.parametrize("read_only", [False, True], ids=["BlockStore", "ReadOnlyStore"])
def test_a_block_file_larger_than_its_largest_frame_is_not_read(
    tmp_path: Path, stored: tuple[list[int], list[Any]], read_only: bool
) -> None:
    """A block file grown to 1 GiB (sparse: it costs the disk nothing, a reader
    everything) is above the largest frame its header's raw size allows: not
    read, a miss; kept, since a size proves nothing a read would not."""
    tokens, cache = stored
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        block = s.directory / "blobs" / s.entries()[0].blocks[-1][:2] / s.entries()[0].blocks[-1]
    with open(block, "r+b") as f:
        f.truncate(1 << 30)
    result = _restore_growth(tmp_path, read_only=read_only)
    assert not result["restored"]
    assert result["grew_kib"] < 128 << 10, result
    assert block.stat().st_size == 1 << 30


_MEASURE_CHECK = textwrap.dedent("""
    import json, os, resource, sys
    from pathlib import Path
    from blockkv import BlockStore
    from blockkv.fs import FileLayer
    from blockkv.local.directory import Directory, read_identity
    from blockkv.local.directory_check import check_directory
    root, ident, planted = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]

    def status_kib(field):
        return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

    def peak_growth_kib(run):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from here
        before = status_kib("VmRSS")
        result = run()
        return result, status_kib("VmHWM") - before

    # a safety net only: today's bug must fail this test, not exhaust the machine
    resource.setrlimit(resource.RLIMIT_AS, (status_kib("VmSize") * 1024 + (3 << 30), resource.RLIM_INFINITY))
    out = {}
    with BlockStore(root, **ident) as s:
        fp = s.directory
        for src, dst in zip(planted[::2], planted[1::2]):  # after the open, whose recovery sweeps orphans unread
            os.rename(src, dst)
        report, out["check_grew_kib"] = peak_growth_kib(  # `blockkv check`
            lambda: check_directory(Directory(fp, read_identity(fp), FileLayer())))
        out["check"] = report.to_json()
        report, out["repair_grew_kib"] = peak_growth_kib(lambda: s.check(repair=True))  # `check --repair`
        out["repair"] = report.to_json()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures peak RSS through /proc (Linux)")
def test_check_reads_no_block_file_past_its_own_frame(
    tmp_path: Path, stored: tuple[list[int], list[Any]]
) -> None:
    """An orphan block has no entry's header to bound its read, so ``check``
    bounds every block by its frame's own header (#32's leftover: it was read
    whole). Four files at 1 GiB (sparse: they cost the disk nothing, a reader
    everything), none of them read: a referenced zstd block and an orphan copy
    of it, longer than a zstd frame can be, are not convicted (a size is no
    proof); an orphan raw frame, longer than its header fixes, and an orphan
    of zeros are convicted on their first bytes. Repair keeps the referenced
    block and its entry, and deletes the orphans as it deletes any block
    nothing references."""
    tokens, cache = stored
    root, ident = tmp_path / "root", {**IDENT, "compression": "zstd"}
    with BlockStore(root, **ident) as s:
        assert s.store(tokens, cache)
        fp, referenced = s.directory, _block(s)
    orphan, raw, zeros = (fp / "blobs" / n[:2] / n for n in (blake3.blake3(bytes([i])).hexdigest() for i in range(3)))
    (tmp_path / orphan.name).write_bytes(referenced.read_bytes())
    (tmp_path / raw.name).write_bytes(frame_head(16, b'[["uint8", [16]]]') + b'[["uint8", [16]]]')
    (tmp_path / zeros.name).touch()
    for path in (*(tmp_path / p.name for p in (orphan, raw, zeros)), referenced):
        with open(path, "r+b") as f:
            f.truncate(1 << 30)
    planted = []
    for path in (orphan, raw, zeros):
        path.parent.mkdir(exist_ok=True)
        planted += [str(tmp_path / path.name), str(path)]
    argv = [sys.executable, "-c", _MEASURE_CHECK, str(root), json.dumps(ident), *planted]
    out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout)
    for run in ("check", "repair"):
        assert out[f"{run}_grew_kib"] < 128 << 10, out
        report = out[run]
        assert report["oversized_blocks"] == sorted([orphan.name, referenced.name]), report
        assert report["corrupt_blocks"] == sorted([raw.name, zeros.name]) and report["dangling"] == [], report
        assert report["orphan_blocks"] == sorted([orphan.name, raw.name, zeros.name]), report
    assert "deleted 3 unreferenced block(s)" in out["repair"]["actions"], out["repair"]
    assert not any(p.exists() for p in (orphan, raw, zeros))
    assert referenced.stat().st_size == 1 << 30
    with BlockStore(root, **ident) as s:
        assert s.find_exact(tokens) is not None  # kept: a miss at restore, never dropped on its size


def test_symlinked_fingerprint_directory_is_refused(tmp_path: Path, stored: tuple[list[int], list[Any]]) -> None:
    tokens, cache = stored
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    with BlockStore(root, **IDENT) as s:
        fp_name = s.directory.name
    (root / fp_name).rename(tmp_path / "moved")
    (outside / "IDENTITY").write_bytes((tmp_path / "moved" / "IDENTITY").read_bytes())
    (root / fp_name).symlink_to(outside)
    with pytest.raises(OSError, match="symlink"):
        BlockStore(root, **IDENT)
    with pytest.raises(OSError, match="symlink"):
        BlockStore.open_dir(root / fp_name)
    assert [p.name for p in outside.iterdir()] == ["IDENTITY"]  # nothing written through the link


def test_linked_shard_and_namespace_directories_are_never_written_or_deleted_through(
    tmp_path: Path, stored: tuple[list[int], list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    tokens, cache = stored
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    with BlockStore(root, gc_grace=0.0, **IDENT) as s:
        # every shard a new block could land in, and the namespace's directory, link out of the root
        links = [s.directory / "blobs" / f"{i:02x}" for i in range(256)]
        links.append(s._dir.header_path("ns", "0" * 32).parent)
        for link in links:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_dir():
                link.rmdir()  # the store made every shard at open: an attacker swaps them
            link.symlink_to(outside)
        assert not s.store(tokens, cache, "ns")  # refused with a warning, not raised
        assert list(outside.iterdir()) == []
        for link in links:
            link.unlink()
        assert s.store(tokens, cache, "ns")
        # now the real shard of a stored block is swapped for a link to a copy outside
        block = _block(s)
        (outside / block.name).write_bytes(block.read_bytes())
        real = block.parent.rename(tmp_path / "real-shard")
        block.parent.symlink_to(outside)
        s.remove(s.find_exact(tokens, "ns").entry)
        s.gc()
        s.check(repair=True)
    assert (outside / block.name).read_bytes() == (real / block.name).read_bytes()  # never deleted through the link
    assert [p.name for p in outside.iterdir()] == [block.name]
