"""One fingerprint directory's files: where things live and how to read them.

Layout of one fingerprint directory (everything else under the root belongs
to other models and is never read, counted or deleted)::

    <root>/.blockkv                      marker: this is a blockkv root
    <root>/<fingerprint dir>/
        IDENTITY                          JSON: model_id, config_fingerprint, tokenizer_hash
        LOCK                              flock(2) target for every mutation
        entries/<ns hash>/<uuid>.bkv      header files (see header.py) — the entries; a
                                          header's mtime is its entry's last use
        blobs/<2 hex>/<64 hex>            content-addressed blocks (see blocks.py, frame.py)
        index/                            LMDB accelerator (see index.py)

Mechanism only (python-diskcache's ``Disk``): listing, reading and verifying
headers, under the names ``format/layout.py`` gives them. The store owns policy (what to keep, when to delete);
``directory_check.inspect_directory`` uses this class alone, so a tool can report on a directory
without opening it as a store and changing anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from blockkv.errors import CorruptError
from blockkv.format.blocks import CODEC_ID, modes
from blockkv.format.header import MAX_HEADER_BYTES, SUFFIX, Header, Identity
from blockkv.format.layout import (
    ENTRY_ID,
    NS_DIR,
    entry_record,
    fingerprint_dirname,
    is_block_name,
    ns_dirname,
    verified_header,
)
from blockkv.fs import TMP_SUFFIX, FileLayer, refuse_linked
from blockkv.pool.local import LocalPool
from blockkv.records import EntryRecord

log = logging.getLogger("blockkv")

ROOT_MARKER = ".blockkv"  # "this is a blockkv root": tools refuse a directory without it


def default_root(platform: str = sys.platform) -> Path:
    """Where ``blockkv serve`` keeps its cache and every ``blockkv`` command
    looks unless told (survives restarts, unlike /tmp): the platform's cache
    directory, ``~/Library/Caches/blockkv`` on macOS (Time Machine and
    Spotlight leave it alone), ``$XDG_CACHE_HOME/blockkv`` (``~/.cache/blockkv``)
    elsewhere. On macOS a cache already at the old default (a blockkv root
    there, none at the new place) is still the one found."""
    old = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockkv"
    if platform != "darwin":
        return old
    new = Path.home() / "Library" / "Caches" / "blockkv"
    return old if (old / ROOT_MARKER).is_file() and not new.exists() else new


_HEADER_REL = re.compile(rf"entries/[0-9a-f]{{16}}/([0-9a-f]{{32}}){re.escape(SUFFIX)}")
_MAX_IDENTITY_BYTES = 1 << 20
_USED_SLACK = 1e-3  # seconds: an mtime this much after the recorded last use is a later use
_ids_mutex = threading.Lock()
_last_id = (0, 0)  # (milliseconds, sequence) of this process's last entry id


def new_entry_id(now: float) -> str:
    """A new entry's id, 32 hex: 48 random bits, the format nibble ``c``, a
    12-bit sequence, ``now`` in milliseconds (48 bits), 16 random bits. The
    id carries the entry's store order (``find``'s tie-break), which a rebuild
    must keep and can no longer read from the header's mtime: that is the
    entry's last use. The sequence keeps one process's ids of a millisecond in
    order; the random bits lead, so a short prefix still names one entry (the
    CLI takes prefixes), as a uuid4's did."""
    global _last_id
    ms = int(now * 1000)
    with _ids_mutex:
        last_ms, seq = _last_id
        if ms <= last_ms:
            ms, seq = (last_ms, seq + 1) if seq < 0xFFF else (last_ms + 1, 0)
        else:
            seq = 0
        _last_id = (ms, seq)
    return f"{secrets.randbits(48):012x}c{seq:03x}{ms & (1 << 48) - 1:012x}{secrets.randbits(16):04x}"


def stored_at(entry_id: str) -> float | None:
    """When an id from ``new_entry_id`` says its entry was stored (ordered as
    the store order); None for another id (a uuid4 of an older blockkv: its
    nibble there is 4)."""
    if len(entry_id) != 32 or entry_id[12] != "c":
        return None
    return int(entry_id[16:28], 16) / 1e3 + int(entry_id[13:16], 16) / 4096e3


def read_identity(path: Path, fs: FileLayer | None = None) -> Identity:
    """The identity recorded in a fingerprint directory's IDENTITY file."""
    try:
        data = (fs or FileLayer()).read(path / "IDENTITY")
        if len(data) > _MAX_IDENTITY_BYTES:
            raise ValueError(f"{len(data)} bytes is not a plausible IDENTITY")
        meta = json.loads(data)
        identity = Identity(meta["model_id"], meta["config_fingerprint"], meta["tokenizer_hash"], CODEC_ID)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FileNotFoundError(f"{path} is not a blockkv fingerprint directory ({exc})") from None
    if fingerprint_dirname(identity.config_fingerprint) != path.name:
        raise ValueError(f"{path}: IDENTITY names the fingerprint of another directory")
    return identity


@dataclass(frozen=True)
class FingerprintDir:
    path: Path
    model_id: str
    config_fingerprint: str
    tokenizer_hash: str


def list_fingerprints(root: str | os.PathLike[str]) -> list[FingerprintDir]:
    """The fingerprint directories under a blockkv root (read-only)."""
    out = []
    for d in sorted(Path(root).expanduser().iterdir()):
        if d.is_dir() and not d.is_symlink() and (d / "IDENTITY").is_file():
            try:
                ident = read_identity(d)
            except (FileNotFoundError, ValueError) as exc:
                log.warning("blockkv: %s; skipped", exc)
                continue
            out.append(FingerprintDir(d, ident.model_id, ident.config_fingerprint, ident.tokenizer_hash))
    return out


@dataclass(frozen=True)
class DiskUsage:
    """What a fingerprint directory takes on disk: the one figure every ``blockkv``
    command prints as "on disk" (docs/cli.md)."""

    total: int  # the apparent size of every file in it: headers, blocks (those awaiting gc too), index, bookkeeping
    outside_entries: int  # of it, the files no entry owns: the LMDB index and the bookkeeping, outside entries/ and blobs/


def disk_usage(path: Path) -> DiskUsage:
    """Every file's apparent size under ``path``, as ``find PATH -type f`` lists
    them (``du -sb`` counts the same files and the directories themselves). A
    file removed while it is counted is left out; links are not followed."""
    total = outside = 0
    for top in os.scandir(path):
        size = _files_bytes(top)
        total += size
        outside += 0 if top.name in ("entries", "blobs") and top.is_dir(follow_symlinks=False) else size
    return DiskUsage(total, outside)


def _files_bytes(entry: os.DirEntry[str]) -> int:
    """The apparent size of ``entry`` if it is a file, of every file under it if it is a directory."""
    try:
        if entry.is_dir(follow_symlinks=False):
            with os.scandir(entry.path) as inside:
                return sum(_files_bytes(e) for e in inside)
        return entry.stat(follow_symlinks=False).st_size if entry.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:
        return 0


def stored_bytes(root: Path) -> int:
    """What a root's fingerprint directories hold on disk (``disk_usage``), for serve's first log line."""
    return sum(disk_usage(fp.path).total for fp in list_fingerprints(root))


@dataclass
class DirectoryListing:
    """What one directory listing found. Paths stay strings: at 10k entries,
    Path objects cost a tenth of an open."""

    headers: dict[str, str]  # entry id -> header path
    blocks: set[str]  # block names
    tmp: list[str]  # our write orphans (dot-prefixed .tmp files)


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


class Directory:
    def __init__(self, path: Path, identity: Identity, fs: FileLayer) -> None:
        self.path = path
        self.identity = identity
        # owner digest -> the identity in each mode: whose entries these files are (another's are foreign)
        self.modes = {mode.digest(): mode for mode in modes(identity)}
        self.fs = fs
        self.pool = LocalPool(path / "blobs", fs)
        self.entries_dir = path / "entries"
        self.index_dir = path / "index"

    def create(self, root: Path) -> None:
        """Make the root (with its marker) and this directory's fixed parts."""
        for fixed in (self.path, self.entries_dir, self.path / "blobs", self.index_dir,
                      self.path / "writers", self.path / "LOCK", self.path / "IDENTITY"):
            refuse_linked(fixed)  # writing through it would write outside the root
        self.fs.makedirs(root)
        marker = root / ROOT_MARKER
        if not marker.exists():
            self.fs.write_atomic(marker, [b"blockkv cache root\n"])
        self.fs.makedirs(self.path / "entries")
        try:  # the default namespace's, as the shards: else a store's first header pays its mkdir and fsync
            self.fs.makedirs(self.entries_dir / ns_dirname(""))
        except OSError:
            pass  # a full disk must not stop an open: made on first use
        self.fs.makedirs(self.path / "blobs")
        self.pool.create_shards()
        ident = self.path / "IDENTITY"
        if not ident.exists():
            body = {"format": 1, "model_id": self.identity.model_id,
                    "config_fingerprint": self.identity.config_fingerprint,
                    "tokenizer_hash": self.identity.tokenizer_hash}
            self.fs.write_atomic(ident, [json.dumps(body, indent=1).encode()])

    def header_path(self, ns: str, entry_id: str) -> Path:
        """Where the header of ``entry_id`` in ``ns`` lives. The id comes from the
        index, which is not trusted as a path: anything but 32 hex is corrupt."""
        if not isinstance(entry_id, str) or not ENTRY_ID.fullmatch(entry_id):
            raise CorruptError(f"entry id {entry_id[:80]!r} is not ours (32 hex)")
        return self.entries_dir / ns_dirname(ns) / f"{entry_id}{SUFFIX}"

    def recorded_header_path(self, entry_id: str, rel: object) -> Path | None:
        """The header path an index record names, if it has our exact shape
        (``entries/<16 hex>/<entry id>.bkv``); None for anything else, such as
        ``../../victim.txt`` or an absolute path planted in the index."""
        if not isinstance(rel, str):
            return None
        m = _HEADER_REL.fullmatch(rel)
        return self.path / rel if m is not None and m.group(1) == entry_id else None

    def mark_used(self, path: Path, when: float) -> None:
        """Record a use of the entry whose header is ``path`` in the header's mtime
        (as the seed does): rebuilds take last use from it, so an index rebuilt
        for any reason keeps the LRU order. Best effort: it may be gone."""
        try:
            os.utime(path, (when, when), follow_symlinks=False)
        except OSError:
            pass

    def used_later(self, entries: list[tuple[str, str]], last_use: dict[str, float]) -> dict[str, float]:
        """Of ``(ns, entry id)`` pairs, those whose header says a use later than
        ``last_use`` records (a restore whose write into the index is pending in
        another handle): id → the header's mtime."""
        later = {}
        for ns, entry_id in entries:
            try:
                mtime = os.lstat(self.header_path(ns, entry_id)).st_mtime
            except (OSError, CorruptError):
                continue
            if mtime > last_use.get(entry_id, 0.0) + _USED_SLACK:
                later[entry_id] = mtime
        return later

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.path))

    def listing(self) -> DirectoryListing:
        """One pass over ``entries/`` and ``blobs/``: our headers, our blocks and
        our write orphans, by name alone (no stat). Nothing else is touched."""
        out = DirectoryListing({}, set(), [])
        for shard, f in self.fs.shard_files(self.entries_dir):
            stem = f.name[: -len(SUFFIX)]
            if f.name.endswith(SUFFIX) and ENTRY_ID.fullmatch(stem) and NS_DIR.fullmatch(shard):
                out.headers[stem] = f.path
            elif _is_tmp(f.name):
                out.tmp.append(f.path)
        for shard, f in self.fs.shard_files(self.pool.directory):
            if f.name[:2] == shard and is_block_name(f.name):
                out.blocks.add(f.name)
            elif _is_tmp(f.name):
                out.tmp.append(f.path)
        return out

    def read_header(self, path: Path) -> Header:
        """Read and verify a header (checksum, bounds, descriptor); CorruptError otherwise."""
        return verified_header(path.name, self._header_bytes(path))

    def header_bytes(self, ns: str, entry_id: str) -> bytes:
        """The header file of ``entry_id`` in ``ns`` as bytes, unverified: a restore
        parses them once (``ParsedEntry``). One too large to be a header is not read."""
        return self._header_bytes(self.header_path(ns, entry_id))

    def _header_bytes(self, path: Path) -> bytes:
        """A header file's bytes; one too large to be a header is not read."""
        size = path.stat().st_size
        if size > MAX_HEADER_BYTES:
            raise CorruptError(f"{path.name}: {size} bytes is not a plausible header")
        return self.fs.read(path)

    def record(self, entry_id: str, path: Path, header: Header, header_bytes: int) -> EntryRecord:
        """The index record a header implies."""
        return entry_record(entry_id, self.rel(path), header, header_bytes)

    def unlink_quietly(self, path: Path) -> None:
        try:
            self.fs.unlink(path)
        except FileNotFoundError:
            pass
