"""Power-loss crash states: what a disk may hold after the power goes out.

``RecordingFileLayer`` is the store's file layer (``blockkv.fs.FileLayer``)
with a log: every file creation, write (with its bytes and offset), file
fsync, rename, unlink, mkdir and directory fsync the store makes through the
seam, in the order they happened. A workload runs on a real directory with
it; ``crash_points()`` then lists every moment the power could have gone out,
and ``materialize(state, dest)`` writes one possible disk after that cut into
an empty directory, where a fresh ``BlockStore`` can be opened on it. Files
are handled generically, by path: the layer knows nothing of headers, blocks
or names, so a file the store starts writing tomorrow is modelled too.

The model (conservative POSIX, the ALICE study's "any un-synced operation may
be lost, independently" — OSDI 2014):

- The directory as it was when recording started is durable (as if
  ``sync(2)`` ran then). That copy is the base every crash state starts from.
- A cut at position ``k`` means operations ``0..k-1`` happened and ``k`` did not.
- File data: a write is durable once a later ``fsync`` of the same file
  happened before the cut. Every other write, independently: landed, lost
  (the file is shorter or has a hole), torn (a prefix landed) or zeroed (the
  size landed, the bytes did not: ext4 ``data=writeback``).
- Names: a create, rename, unlink or mkdir is durable once a later
  ``fsync`` of its parent directory happened before the cut. Every other one
  is, independently, done or undone. An fsync of a file does not make its
  name durable. A rename is atomic and moves an inode, so a durable rename
  of a file whose creation was undone still shows the file under its new
  name. A rename between two directories is durable at its target once the
  target directory is fsynced; until the source directory is too, the old
  name may survive beside the new one. Everything under a directory whose
  mkdir was undone is gone.
- The LMDB index is not written through the seam (LMDB does its own I/O), so
  each crash point carries a copy of every ``data.mdb`` under the root as of
  that moment, and a crash state takes one of three forms: ``"lost"`` (no
  environment: never synced), ``"previous-boot"`` (the last commit before
  the cut, from a boot that has ended: after a power cut
  the boot id (``lmdb_env.boot_id``) differs, so the store trusts it only
  if it was settled, its ``index.settled`` marker present, and otherwise rebuilds
  the tables from the files; a marker, written through the seam, is durable
  before any commit it covers, so the last commit of a cut without one is
  the one the settle synced), or ``"synced"`` (the last
  commit before the cut, trusted: where no boot id exists, transactions
  are synced and the store reconciles them with the files).
  LMDB without sync can also leave a torn environment after a power cut;
  that is not modelled here (docs/design.md's known limits).
- A crash point is a log position and the LMDB contents at that moment:
  when LMDB committed between two operations, the moments just after the
  first and just before the second are two crash points.
- On macOS only ``fcntl(F_FULLFSYNC)`` is a barrier: a plain ``fsync``
  leaves the data in the drive's cache, and ``F_FULLFSYNC`` flushes the
  whole cache. A recorder whose ``platform`` is ``"darwin"`` (the default on
  a Mac; pass it on Linux to check macOS's barrier path) models that: a
  plain fsync (``cached``) makes nothing durable until a later full one,
  which makes every cached one before it durable too; a file's writes after
  its plain fsync are not covered. Elsewhere every fsync is a barrier.

The recorder does not call the real ``fsync``: the crash states come from the
log, not from the disk, and skipping it keeps recording fast. It names an
fd's file through ``/proc/self/fd`` on Linux, ``F_GETPATH`` on macOS. Not modelled: directory
renames (the store makes none), and a write_atomic's own clean-up unlink after
a failed write (recording runs are fault-free).
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import stat
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lmdb

from blockkv.fs import Buffer, FileLayer

Fate = Literal["landed", "lost", "torn", "zeroed"]
IndexForm = Literal["lost", "previous-boot", "synced"]
INDEX_FORMS: tuple[IndexForm, ...] = ("lost", "previous-boot", "synced")
FATES: tuple[Fate, ...] = ("landed", "lost", "torn", "zeroed")
NAME_OPS = frozenset({"create", "mkdir", "rename", "unlink"})
LMDB_FILE = "data.mdb"
PREVIOUS_BOOT = b"a boot that ended in a power cut"


@dataclass(frozen=True)
class Op:
    """One recorded operation; paths are relative to the recorded root."""

    kind: Literal["create", "mkdir", "write", "fsync", "fsync_dir", "rename", "unlink"]
    path: str
    inode: int = -1  # the recorder's own inode number (never reused); -1: unknown
    dst: str = ""  # rename target
    offset: int = 0  # write offset
    data: bytes = b""  # the bytes a write landed
    cached: bool = False  # an fsync that left it in the drive's cache (macOS's plain fsync)


@dataclass(frozen=True)
class CrashPoint:
    """The power goes out after ``ops`` operations, with LMDB as ``lmdb_version``."""

    ops: int
    lmdb_version: int


@dataclass(frozen=True)
class CrashState:
    """One possible disk after a cut: which un-synced name operations happened
    (by log position) and what became of each un-synced write."""

    point: CrashPoint
    names_done: frozenset[int]
    writes: tuple[tuple[int, Fate, int], ...]  # (log position, fate, bytes kept if torn)
    index: IndexForm
    label: str = field(default="", compare=False)


@dataclass
class _Uncertain:
    names: list[int] = field(default_factory=list)  # name operations not yet made durable
    writes: list[int] = field(default_factory=list)  # writes not yet made durable
    linked: set[int] = field(default_factory=set)  # renames durable at their target, not yet at their source


def _parent(path: str) -> str:
    return os.path.dirname(path)


class RecordingFileLayer(FileLayer):
    """A FileLayer that logs every durability-relevant operation under ``root``.

    ``base`` receives a copy of ``root`` as it is now: the durable starting
    point of every crash state. Use one recorder per workload."""

    def __init__(self, root: Path, base: Path, platform: str = sys.platform) -> None:
        self.platform = platform  # whose barrier path the store runs, and the model follows
        self.root = Path(root).resolve()
        self.base = Path(base)
        self.log: list[Op] = []
        self._lock = threading.Lock()
        self._next_inode = 0
        self._paths: dict[str, int] = {}  # what the live directory holds now: path -> inode
        self.base_files: dict[str, int] = {}
        self.base_dirs: set[str] = {""}
        self._base_source: dict[int, str] = {}  # inode -> its path in the base copy
        self._lmdb_versions: list[dict[str, bytes]] = []  # distinct LMDB contents, in order seen
        self._lmdb_before: list[int] = []  # per log position: LMDB version just before the op
        self._lmdb_after: list[int] = []  # per log position: LMDB version just after the op
        self._lmdb_stat: dict[str, tuple[int, int]] | None = None
        self._finished: int | None = None
        shutil.copytree(self.root, self.base, symlinks=True)
        for dirpath, dirnames, filenames in os.walk(self.base):
            rel = os.path.relpath(dirpath, self.base)
            rel = "" if rel == "." else rel
            if LMDB_FILE in filenames:  # an LMDB environment: modelled by its snapshots, not as files
                self.base_dirs.discard(rel)
                dirnames.clear()
                continue
            self.base_dirs.update(os.path.join(rel, d) for d in dirnames)
            for name in filenames:
                path = os.path.join(rel, name)
                inode = self._new_inode()
                self.base_files[path] = inode
                self._base_source[inode] = path
        self._paths = dict(self.base_files)
        self._snapshot_lmdb()

    # -- the seam -----------------------------------------------------------------
    def write(self, fd: int, buffers: Sequence[Buffer]) -> int:
        with self._lock:
            path = self._fd_path(fd)
            inode = self._inode_at(path)
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            before = self._snapshot_lmdb()
            n = super().write(fd, buffers)
            data = b"".join(memoryview(b).cast("B").tobytes() for b in buffers)[:n]
            self._append(Op("write", path, inode, offset=offset, data=data), before)
            return n

    def full_fsync(self, fd: int) -> None:
        self._log_fsync(fd, cached=False)

    def plain_fsync(self, fd: int) -> None:
        self._log_fsync(fd, cached=self.platform == "darwin")

    def _log_fsync(self, fd: int, *, cached: bool) -> None:
        with self._lock:
            path = self._fd_path(fd)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                self._append(Op("fsync_dir", path, cached=cached))
            else:
                self._append(Op("fsync", path, self._inode_at(path), cached=cached))  # not performed: see the docstring

    def replace(self, src: Path, dst: Path) -> None:
        with self._lock:
            s, d = self._rel(src), self._rel(dst)
            if os.path.isdir(src):
                raise NotImplementedError("the power-loss model does not cover directory renames")
            inode = self._inode_at(s)
            before = self._snapshot_lmdb()
            super().replace(src, dst)
            self._paths[d] = self._paths.pop(s)
            self._append(Op("rename", s, inode, dst=d), before)

    def unlink(self, path: Path) -> None:
        with self._lock:
            p = self._rel(path)
            before = self._snapshot_lmdb()
            super().unlink(path)
            self._append(Op("unlink", p, self._paths.pop(p, -1)), before)

    def mkdir(self, path: Path) -> None:
        with self._lock:
            before = self._snapshot_lmdb()
            super().mkdir(path)
            self._append(Op("mkdir", self._rel(path)), before)

    # -- recording helpers ---------------------------------------------------------
    def _new_inode(self) -> int:
        self._next_inode += 1
        return self._next_inode

    def _rel(self, path: Path | str) -> str:
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise ValueError(f"{path} is outside the recorded root {self.root}")
        return "" if rel == "." else rel

    def _fd_path(self, fd: int) -> str:
        if hasattr(fcntl, "F_GETPATH"):  # macOS: no /proc
            return self._rel(fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).split(b"\0", 1)[0].decode())
        return self._rel(os.readlink(f"/proc/self/fd/{fd}"))

    def _inode_at(self, path: str) -> int:
        """The inode a path names; a file first seen now was created outside the
        seam (``os.open(O_CREAT)``), so its creation is logged here."""
        inode = self._paths.get(path)
        if inode is None:
            inode = self._paths[path] = self._new_inode()
            self._append(Op("create", path, inode))
            size = os.path.getsize(self.root / path) if os.path.isfile(self.root / path) else 0
            if size:  # bytes written outside the seam: un-synced like any others
                self._append(Op("write", path, inode, data=(self.root / path).read_bytes()))
        return inode

    def _append(self, op: Op, lmdb_before: int | None = None) -> None:
        """Log ``op`` (already performed) with the LMDB contents just before and just after it."""
        if self._finished is not None:
            raise RuntimeError("recording already finished")
        after = self._snapshot_lmdb()
        self._lmdb_before.append(after if lmdb_before is None else lmdb_before)
        self._lmdb_after.append(after)
        self.log.append(op)

    def _snapshot_lmdb(self) -> int:
        """The LMDB contents now, as a version number (a new one only when a file changed)."""
        found: dict[str, Path] = {}
        for dirpath, _, filenames in os.walk(self.root):
            if LMDB_FILE in filenames:
                found[os.path.relpath(dirpath, self.root)] = Path(dirpath) / LMDB_FILE
        stats = {}
        for rel, p in found.items():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            stats[rel] = (st.st_mtime_ns, st.st_size)
        if self._lmdb_versions and stats == self._lmdb_stat:
            version = len(self._lmdb_versions) - 1
        else:
            self._lmdb_versions.append({rel: found[rel].read_bytes() for rel in stats})
            self._lmdb_stat = stats
            version = len(self._lmdb_versions) - 1
        return version

    def finish(self) -> None:
        """Stop recording (after the workload closed its store): the last crash point."""
        with self._lock:
            if self._finished is None:
                self._finished = self._snapshot_lmdb()

    # -- crash points and states ------------------------------------------------------
    def crash_points(self) -> list[CrashPoint]:
        """Every moment the power could go out, in order."""
        if self._finished is None:
            raise RuntimeError("call finish() first")
        points: list[CrashPoint] = []
        for k in range(len(self.log) + 1):
            before = self._lmdb_before[k] if k < len(self.log) else self._finished
            if k > 0 and self._lmdb_after[k - 1] != before:  # LMDB committed between op k-1 and op k
                points.append(CrashPoint(k, self._lmdb_after[k - 1]))
            points.append(CrashPoint(k, before))
        return points

    def uncertain(self, k: int) -> _Uncertain:
        """What a cut after ``k`` operations leaves undecided."""
        synced_upto: dict[int, int] = {}  # inode -> position of its last fsync
        dir_synced: dict[str, int] = {}  # directory -> position of its last fsync
        cached: list[tuple[int, Op]] = []  # fsyncs in the drive's cache, until a full one flushes it
        for i, op in enumerate(self.log[:k]):
            if op.kind not in ("fsync", "fsync_dir"):
                continue
            if op.cached:
                cached.append((i, op))
                continue
            for j, c in [*cached, (i, op)]:
                if c.kind == "fsync":
                    synced_upto[c.inode] = max(j, synced_upto.get(c.inode, -1))
                else:
                    dir_synced[c.path] = max(j, dir_synced.get(c.path, -1))
            cached.clear()
        out = _Uncertain()
        for i, op in enumerate(self.log[:k]):
            if op.kind == "write" and synced_upto.get(op.inode, -1) < i:
                out.writes.append(i)
            elif op.kind in NAME_OPS:
                at = _parent(op.dst) if op.kind == "rename" else _parent(op.path)
                if dir_synced.get(at, -1) < i:
                    out.names.append(i)
                elif op.kind == "rename" and dir_synced.get(_parent(op.path), -1) < i:
                    out.names.append(i)  # "undone" keeps the old name too
                    out.linked.add(i)
        return out

    def states(self, point: CrashPoint, rng: random.Random, n_random: int = 2,
               exhaustive_upto: int = 0) -> list[CrashState]:
        """Crash states for one cut: nothing un-synced survived (index lost);
        everything did (index from the previous boot); everything did with a
        synced index (what a process crash leaves); ``n_random`` random mixes;
        and, when at most ``exhaustive_upto`` name operations are undecided,
        every subset of them."""
        u = self.uncertain(point.ops)
        all_names = frozenset(u.names)
        out = [
            CrashState(point, frozenset(), tuple((i, "lost", 0) for i in u.writes), "lost", "nothing un-synced"),
            CrashState(point, all_names, tuple((i, "landed", 0) for i in u.writes), "previous-boot", "all landed"),
            CrashState(point, all_names, tuple((i, "landed", 0) for i in u.writes), "synced", "process crash"),
        ]
        for _ in range(n_random):
            out.append(self._random_state(point, u, frozenset(i for i in u.names if rng.random() < 0.5), rng))
        if 0 < len(u.names) <= exhaustive_upto:
            for mask in range(1, (1 << len(u.names)) - 1):
                done = frozenset(i for b, i in enumerate(u.names) if mask >> b & 1)
                out.append(self._random_state(point, u, done, rng, "subset"))
        return list(dict.fromkeys(out))

    def _random_state(self, point: CrashPoint, u: _Uncertain, names_done: frozenset[int],
                      rng: random.Random, label: str = "random") -> CrashState:
        writes = []
        for i in u.writes:
            fate = rng.choice(FATES)
            size = len(self.log[i].data)
            writes.append((i, fate, rng.randrange(size) if fate == "torn" and size else 0))
        return CrashState(point, names_done, tuple(writes), rng.choice(INDEX_FORMS), label)

    # -- building a crash state on disk --------------------------------------------------
    def materialize(self, state: CrashState, dest: Path) -> None:
        """Write the disk ``state`` describes into ``dest`` (which must not exist)."""
        k = state.point.ops
        u = self.uncertain(k)
        undecided_names = set(u.names)
        fates = {i: (fate, keep) for i, fate, keep in state.writes}
        undecided_writes = set(u.writes)
        files = dict(self.base_files)
        dirs = set(self.base_dirs)
        content: dict[int, bytearray] = {}

        def data(inode: int) -> bytearray:
            if inode not in content:
                src = self._base_source.get(inode)
                content[inode] = bytearray((self.base / src).read_bytes()) if src is not None else bytearray()
            return content[inode]

        for i, op in enumerate(self.log[:k]):
            if op.kind in NAME_OPS and i in undecided_names and i not in state.names_done:
                if i in u.linked:  # the new name is durable; the old one is not yet gone
                    files[op.dst] = op.inode
                continue  # undone by the power cut
            if op.kind == "create":
                files[op.path] = op.inode
            elif op.kind == "mkdir":
                dirs.add(op.path)
            elif op.kind == "rename":
                files[op.dst] = op.inode
                if files.get(op.path) == op.inode:
                    del files[op.path]
            elif op.kind == "unlink":
                if op.inode == -1 or files.get(op.path) == op.inode:
                    files.pop(op.path, None)
            elif op.kind == "write":
                fate, keep = fates.get(i, ("landed", 0)) if i in undecided_writes else ("landed", 0)
                if fate == "lost":
                    continue
                body = op.data[:keep] if fate == "torn" else bytes(len(op.data)) if fate == "zeroed" else op.data
                buf = data(op.inode)
                end = op.offset + len(body)
                if len(buf) < end:
                    buf.extend(bytes(end - len(buf)))
                buf[op.offset:end] = body

        def reachable(path: str) -> bool:
            parent = _parent(path)
            while parent:
                if parent not in dirs:
                    return False
                parent = _parent(parent)
            return True

        dest.mkdir(parents=True)
        for d in sorted(dirs, key=len):
            if d and reachable(d):
                (dest / d).mkdir(mode=0o700)
        for path, inode in files.items():
            if reachable(path):
                (dest / path).write_bytes(bytes(data(inode)))
        self._materialize_lmdb(state, dest)

    def _materialize_lmdb(self, state: CrashState, dest: Path) -> None:
        if state.index == "lost":
            return
        for rel, body in self._lmdb_versions[state.point.lmdb_version].items():
            env_dir = dest / rel
            if not env_dir.parent.is_dir():
                continue  # the directory that held it did not survive
            env_dir.mkdir(mode=0o700, exist_ok=True)
            (env_dir / LMDB_FILE).write_bytes(body)
            if state.index == "previous-boot":
                _mark_previous_boot(env_dir, len(body))


def _mark_previous_boot(env_dir: Path, size: int) -> None:
    """Record another boot's id in the environment's ``meta`` table (index.py's
    ``boot`` key), as a reboot after the power cut would make it look."""
    env = lmdb.open(str(env_dir), map_size=max(2 * size, 1 << 20), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            try:
                meta = env.open_db(b"meta", txn=txn, create=False)
            except lmdb.NotFoundError:
                return  # no tables yet: the store starts from scratch anyway
            txn.put(b"boot", PREVIOUS_BOOT, db=meta)
    finally:
        env.close()

