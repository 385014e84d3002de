"""The store's file layer: every syscall that touches the cache directory.

It is one class so that it is one seam: fault tests subclass it and make
``write``, ``fsync`` or ``replace`` fail (ENOSPC, EIO, a torn write) without
mocking the disk. Everything above it speaks in whole files.

Filesystem assumptions (written down in docs/design.md): a local POSIX
filesystem where ``rename`` within a directory is atomic, ``fsync`` of a file
makes its bytes durable and ``fsync`` of its directory makes the rename
durable; ``flock`` locks are released by the kernel when a process dies.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from blockkv.errors import NotRegularFileError, OversizedError

Buffer = bytes | bytearray | memoryview

TMP_SUFFIX = ".tmp"
_IOV_MAX = 512
_READ_RUN = 512 << 10  # bytes a restore reads before checking them (fits a core's L2)
_SYNC_THREADS = 16  # directory fsyncs in flight at once (they wait on the disk, not the CPU)
_SYMLINK_ERRNOS = (errno.ELOOP, errno.EMLINK)  # O_NOFOLLOW on a link: Linux and macOS, FreeBSD
_FULLFSYNC_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY)  # a filesystem without it
FILE_MODE = 0o600
DIR_MODE = 0o700


def tmp_name(final: Path, tag: str = "") -> Path:
    """A temporary name beside ``final``: dot-prefixed, random, ``.tmp``-suffixed,
    so a scan can never mistake it for a finished file (oMLX's lesson). ``tag``
    names the writer (its intent-file token): its liveness decides when the
    file may be reaped (writers.py)."""
    middle = f"{tag}.{secrets.token_hex(4)}" if tag else secrets.token_hex(6)
    return final.with_name(f".{final.name}.{middle}{TMP_SUFFIX}")


def refuse_linked(path: Path) -> None:
    """OSError(ELOOP) if ``path`` (a directory or file blockkv creates) is a
    symlink: nothing is written through a link out of the root."""
    if path.is_symlink():
        raise OSError(errno.ELOOP, "a symlink where blockkv keeps its own files; not followed", str(path))


def _runs(buffers: Sequence[memoryview]) -> Iterator[tuple[Sequence[memoryview], int]]:
    """Consecutive buffers, in order, about ``_READ_RUN`` bytes (at least one
    buffer, at most ``_IOV_MAX``) at a time, each with its size in bytes."""
    start, size = 0, 0
    for i, b in enumerate(buffers):
        size += b.nbytes
        if size >= _READ_RUN or i + 1 - start == _IOV_MAX:
            yield buffers[start : i + 1], size
            start, size = i + 1, 0
    if start < len(buffers):
        yield buffers[start:], size


def _read_rest(fd: int, run: Sequence[memoryview], offset: int, done: int) -> bool:
    """The rest of ``run`` after a scatter read at ``offset`` filled only its
    first ``done`` bytes; False if the file ends first."""
    pending = [b for b in run if b.nbytes]
    _advance(pending, done)
    offset += done
    while pending:
        n = os.preadv(fd, pending, offset)
        if n <= 0:
            return False
        offset += n
        _advance(pending, n)
    return True


def _advance(pending: list[memoryview], n: int) -> None:
    """After a scatter read or gather write moved ``n`` bytes: drop the buffers
    that landed whole, keep the rest of a partial one."""
    while n and pending:
        if n >= pending[0].nbytes:
            n -= pending.pop(0).nbytes
        else:
            pending[0], n = pending[0][n:], 0


class FileLayer:
    """Durable file primitives. Subclass and override a primitive to inject faults.

    ``platform`` chooses the barrier ``fsync`` uses: a layer on Linux that
    sets it to ``"darwin"`` runs macOS's (tests/local/test_darwin_flush.py)."""

    platform: str = sys.platform

    # -- primitives (the seam) --------------------------------------------
    def write(self, fd: int, buffers: Sequence[Buffer]) -> int:
        """Write ``buffers`` in order with one syscall (it may write less: the caller loops)."""
        return os.writev(fd, buffers)

    def fsync(self, fd: int) -> None:
        """The durability barrier, for a file or a directory: when it returns,
        what was written to ``fd`` survives a power cut. On macOS that takes
        ``F_FULLFSYNC`` (a plain ``fsync`` leaves the data in the drive's
        cache); a filesystem that does not support it (it says so with
        ENOTSUP, EINVAL or ENOTTY) gets a plain ``fsync``. Any other failure,
        EIO first, is raised: the caller must not acknowledge what it covers."""
        if self.platform == "darwin":
            try:
                self.full_fsync(fd)
                return
            except OSError as exc:
                if exc.errno not in _FULLFSYNC_UNSUPPORTED:
                    raise
        self.plain_fsync(fd)

    def full_fsync(self, fd: int) -> None:
        """macOS's barrier that reaches the medium (``fcntl(F_FULLFSYNC)``)."""
        import fcntl

        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)

    def plain_fsync(self, fd: int) -> None:
        os.fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        """A second name for ``src``; FileExistsError if ``dst`` exists: publishing
        by link is create-if-absent, where a rename would replace."""
        os.link(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def open_regular(self, path: Path) -> int:
        """A read-only fd of ``path`` if it is a regular file, else NotRegularFileError.

        Every read of a header, block or IDENTITY opens through here: a symlink
        is not followed (O_NOFOLLOW), a FIFO cannot block the open (O_NONBLOCK)
        and nothing but a regular file is read, so a planted FIFO, device or
        link to /dev/zero can neither hang a reader nor feed it without bound."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno in _SYMLINK_ERRNOS:  # O_NOFOLLOW met a symlink
                raise NotRegularFileError(f"{path} is a symlink; not followed") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFileError(f"{path} is not a regular file; not read")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, path: Path) -> None:
        os.mkdir(path, DIR_MODE)

    def read(self, path: Path, limit: int | None = None) -> bytes:
        """The whole file, at most its size when opened (a growing file cannot feed us more);
        ``OversizedError``, unread, if that size is above ``limit``."""
        with open(self.open_regular(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise OversizedError(f"{path}: {size} bytes, more than the {limit} it can be; not read")
            return f.read(size)

    def read_head(self, path: Path, n: int) -> bytes:
        """The first ``n`` bytes of the file (all of it if it is shorter)."""
        with open(self.open_regular(path), "rb", buffering=0) as f:
            return f.read(n)

    def read_exact(self, path: Path, buffers: Sequence[memoryview],
                   on_read: Callable[[Sequence[memoryview]], None] | None = None) -> bool:
        """Fill ``buffers`` in order from the file with scatter reads, if the file
        is exactly as long as they are together; False (nothing trusted) if it
        is not, or shrinks while we read. This is the one place a block file is
        opened for a restore.

        The buffers are read in runs of about ``_READ_RUN`` bytes, and
        ``on_read`` (if given) gets each run of whole buffers as soon as it is
        filled: a checksum fed there meets the bytes in the CPU cache instead of
        reading them back from memory (a warm restore's fill, 8 MiB blocks of
        32 KiB pieces on 2 threads: 45 ms against 53 ms)."""
        want = sum(b.nbytes for b in buffers)
        with open(self.open_regular(path), "rb", buffering=0) as f:
            fd = f.fileno()
            if os.fstat(fd).st_size != want:
                return False
            offset = 0
            for run, size in _runs(buffers):
                # a run from the page cache comes whole in one call: no per-buffer bookkeeping
                # (8,704 buffers of 32 KiB, one thread: 1.5-2 ms less CPU a restore)
                n = os.preadv(fd, run, offset) if size else 0
                if n != size and not _read_rest(fd, run, offset, n):
                    return False
                offset += size
                if on_read is not None:
                    on_read(run)
            return True

    def crash_point(self, name: str) -> None:
        """A named point inside store/remove/gc (e.g. ``"store:refs-taken"``).

        A no-op here; a fault layer raises at it to model a process dying
        between two steps of a write or delete order."""

    # -- composed operations ----------------------------------------------
    def fsync_dir(self, path: Path) -> None:
        self._sync_dir(path, self.fsync)

    def makedirs(self, path: Path) -> None:
        """Create ``path`` (0700) and any missing parents, making each new name durable."""
        missing: list[Path] = []
        p = path
        while not p.is_dir():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                self.mkdir(d)
            except FileExistsError:
                continue
            self.fsync_dir(d.parent)

    def write_atomic(self, path: Path, parts: Sequence[Buffer], *, sync_dir: bool = True, tag: str = "") -> int:
        """tmp in the target directory → write → fsync → rename → fsync dir.

        A crash at any point leaves either no file or the whole file; the tmp
        file is removed on failure. Returns the bytes written.
        """
        tmp, total = self.write_tmp(path, parts, tag=tag)
        try:
            self.replace(tmp, path)
        except BaseException:
            self.unlink_tmp(tmp)
            raise
        if sync_dir:
            self.fsync_dir(path.parent)
        return total

    def write_tmp(self, path: Path, parts: Sequence[Buffer], *, tag: str = "",
                  batched: bool = False) -> tuple[Path, int]:
        """The first half of ``write_atomic``: a durable tmp file beside ``path``
        (write → fsync), removed on failure. Returns it and the bytes written;
        ``publish`` renames a batch of them. ``tag`` names the writer (writers.py).
        ``batched``: only ``publish`` will name it, and on macOS its data is
        made durable by the batch's one drive flush there, not one of its own."""
        tmp = tmp_name(path, tag)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except OSError as exc:  # name the file the caller asked for, not our temporary one
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        try:
            total = 0
            try:
                pending = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
                while pending:
                    n = self.write(fd, pending[:_IOV_MAX])
                    if n <= 0:
                        raise OSError(errno.EIO, "short write", str(path))
                    total += n
                    _advance(pending, n)
                if batched and self.platform == "darwin":
                    self.plain_fsync(fd)  # in the drive's cache: publish flushes it before any rename
                else:
                    self.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            self.unlink_tmp(tmp)
            raise
        return tmp, total

    def publish(self, moves: Sequence[tuple[Path, Path]]) -> None:
        """Rename every (tmp, final) pair, then fsync each directory they touch
        once: when this returns, every name is durable. A batch pays one
        directory fsync per directory instead of one per file, and issues
        them together (``fsync_dirs``). On failure the caller removes the tmp
        files not yet renamed (``unlink_tmp``).

        On macOS the tmp files were written ``batched`` (a plain fsync each:
        their data is in the drive's cache), so one ``F_FULLFSYNC`` (it
        flushes the whole drive cache) makes all their data durable before
        the first rename; ``fsync_dirs`` then ends with one more for the
        names. Two drive flushes per batch instead of two per file."""
        if moves and self.platform == "darwin":
            self.fsync_dir(moves[0][1].parent)
        for tmp, final in moves:
            self.replace(tmp, final)
        self.fsync_dirs(final.parent for _, final in moves)

    def fsync_dirs(self, paths: Iterable[Path]) -> None:
        """``fsync_dir`` each distinct directory, all in flight at once. Each
        fsync waits for a journal commit and a device cache flush; issued
        together they share them, one after another each pays its own (16
        shard directories on ext4: 2.6 ms together, 7-34 ms in turn).
        Re-raises the first failure once every one has returned. On macOS
        every directory but the last gets a plain fsync, and the last, once
        they have all returned, the ``F_FULLFSYNC`` that flushes the drive's
        cache for them all: one drive flush for the batch."""
        dirs = list(dict.fromkeys(paths))
        errors: list[BaseException] = []
        darwin = self.platform == "darwin"
        last = dirs.pop() if darwin and dirs else None

        def run(share: list[Path]) -> None:
            for d in share:
                try:
                    if darwin:
                        self._plain_fsync_dir(d)
                    else:
                        self.fsync_dir(d)
                except BaseException as exc:  # noqa: BLE001 - re-raised below, once all have returned
                    errors.append(exc)

        shares = [dirs[i::_SYNC_THREADS] for i in range(min(len(dirs), _SYNC_THREADS))]
        threads = [threading.Thread(target=run, args=(share,), name="blockkv-dirsync") for share in shares[1:]]
        for t in threads:
            t.start()
        if shares:
            run(shares[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if last is not None:
            self.fsync_dir(last)

    def _plain_fsync_dir(self, path: Path) -> None:
        """macOS: a directory's changes into the drive's cache; a later ``fsync_dir`` flushes them."""
        self._sync_dir(path, self.plain_fsync)

    @staticmethod
    def _sync_dir(path: Path, sync: Callable[[int], None]) -> None:
        """Open directory ``path`` and apply ``sync`` to it: its names are
        made durable through an fd of the directory itself."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            sync(fd)
        finally:
            os.close(fd)

    def unlink_tmp(self, tmp: Path) -> None:
        """Remove a tmp file if it is still there (cleanup: never raises)."""
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def scandir(self, path: Path) -> Iterator[os.DirEntry[str]]:
        """Entries of ``path``; nothing if it is missing or not a directory."""
        try:
            with os.scandir(path) as it:
                yield from it
        except (FileNotFoundError, NotADirectoryError):
            return

    def shard_files(self, directory: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """(subdirectory name, regular file) for every file one level down.

        Symlinks and anything that is not a plain file or directory are skipped:
        the store never follows a link out of its root."""
        for shard in self.scandir(directory):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for f in self.scandir(Path(shard.path)):
                if f.is_file(follow_symlinks=False):
                    yield shard.name, f
