"""What a store's remote tier keeps on the local disk, beside the fingerprint
directory (tier.py): copies of the bucket's headers, and the backlog of
stores the bucket has not acknowledged. Neither is fsynced: a copy lost or
torn by a power cut fails its checksum or is missing and is fetched again; a
backlog marker lost leaves its entry local-only."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from blockkv.bucket.bucket_dir import HeaderCopy
from blockkv.errors import CorruptError, NewerFormatError
from blockkv.format.header import MAX_HEADER_BYTES
from blockkv.format.layout import ENTRY_ID
from blockkv.fs import DIR_MODE, FILE_MODE, FileLayer, refuse_linked

_MARK_BYTES = 128  # more than a backlog mark's MAC
_COPY_MAGIC = b"BKVRH1 "  # a cached copy: this, the object's ETag, a newline, the header's bytes
_MAX_COPY_BYTES = MAX_HEADER_BYTES + 256


class HeaderCache:
    """``remote-headers/<ns dir>/<uuid>.bkv``: copies of the bucket's headers,
    each with the ETag of the object it copies, so a node that restarts reads
    the remote catalog from its disk, fetches only headers new to it, and
    drops a copy the bucket's object no longer matches."""

    def __init__(self, directory: Path, fs: FileLayer, warn: Callable[[str, str], None]) -> None:
        self.directory = directory
        self._fs = fs
        self._warn = warn

    def get(self, names: Iterable[str], verify: Callable[[str, bytes, str], HeaderCopy]) -> dict[str, HeaderCopy]:
        """The copies of ``names`` the cache holds, each checked by ``verify(name,
        bytes, etag)``; one too large to be a copy is not read, and one that does
        not verify is removed."""
        found = {}
        for name in names:
            try:
                data, etag = self._read(self.directory / name)
                found[name] = verify(name, data, etag)
            except (CorruptError, NewerFormatError):
                self.drop([name])
            except (OSError, MemoryError):
                continue  # not cached (or unreadable now): fetched
        return found

    def _read(self, path: Path) -> tuple[bytes, str]:
        """A copy's bytes and ETag; its size is checked before anything is read."""
        with open(self._fs.open_regular(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_COPY_BYTES:
                raise CorruptError(f"{path.name}: {size} bytes is not a cached header")
            raw = f.read(size)
        head, newline, data = raw.partition(b"\n")
        if not newline or not head.startswith(_COPY_MAGIC):
            raise CorruptError(f"{path.name} is not a cached header")
        return data, head[len(_COPY_MAGIC):].decode("ascii", "replace")

    def read(self, name: str) -> tuple[bytes, str] | None:
        """A copy's bytes and ETag, unverified (the caller verifies), or None if
        there is none; one that is not a cached copy at all is removed."""
        try:
            return self._read(self.directory / name)
        except CorruptError:
            self.drop([name])
        except (OSError, MemoryError):
            pass
        return None

    def spool(self) -> Path | None:
        """Where a MANIFEST may be spooled (unnamed files): the cache's
        directory when it is ours, else the system's temporary directory."""
        try:
            refuse_linked(self.directory)
            os.makedirs(self.directory, DIR_MODE, exist_ok=True)
        except OSError:
            return None
        return self.directory

    def keep(self, copies: Mapping[str, HeaderCopy]) -> None:
        """Cache verified copies: tmp then rename, no fsync (a copy lost or torn
        by a power cut fails its checksum or is missing, and is fetched again)."""
        try:
            refuse_linked(self.directory)
            made: set[Path] = set()
            for name, copy in copies.items():
                path = self.directory / name
                if path.parent not in made:
                    refuse_linked(path.parent)
                    os.makedirs(path.parent, DIR_MODE, exist_ok=True)
                    made.add(path.parent)
                tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
                with open(fd, "wb") as f:
                    f.write(_COPY_MAGIC + copy.etag.encode("ascii", "replace") + b"\n" + copy.data)
                os.replace(tmp, path)
        except OSError as exc:
            self._warn("remote-cache", f"could not cache headers in {self.directory} ({exc}); they are fetched again")

    def drop(self, names: Iterable[str]) -> None:
        """Unlink cached copies (never through a linked directory: only what is ours)."""
        for name in names:
            path = self.directory / name
            try:
                refuse_linked(self.directory)
                refuse_linked(path.parent)
                os.unlink(path)
            except OSError:
                pass

    def prune(self, listed: Mapping[str, object]) -> None:
        """Remove cached copies of headers gone from the bucket (and stray temp files)."""
        try:
            refuse_linked(self.directory)
            shards = [d for d in os.scandir(self.directory) if d.is_dir(follow_symlinks=False)]
            stale = [f"{d.name}/{f.name}" for d in shards for f in os.scandir(d.path)
                     if f"{d.name}/{f.name}" not in listed]
        except OSError:
            return
        self.drop(stale)


class Backlog:
    """``backlog/<entry id>``: a file per store whose upload the bucket has not
    acknowledged, for a later sync to send. With a fleet key it holds the
    store's MAC over the header it wrote (``FleetKey.backlog_body``), so a
    header planted in the root by someone without the key is never sealed."""

    def __init__(self, directory: Path, warn: Callable[[str, str], None]) -> None:
        self.directory = directory
        self._warn = warn

    def mark(self, entry_id: str, body: bytes = b"") -> None:
        """Put an entry in the backlog before its upload (not fsynced: a power
        cut may lose it, and the entry then stays local-only)."""
        try:
            refuse_linked(self.directory)
            if not self.directory.is_dir():
                os.makedirs(self.directory, DIR_MODE, exist_ok=True)
            fd = os.open(self.directory / entry_id, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, FILE_MODE)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
        except OSError as exc:
            self._warn("remote-backlog", f"could not record entry {entry_id} in {self.directory}: {exc}")

    def unmark(self, entry_id: str) -> None:
        try:
            refuse_linked(self.directory)
            os.unlink(self.directory / entry_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn("remote-backlog", f"could not clear {self.directory / entry_id}: {exc}")

    def body(self, entry_id: str) -> bytes:
        """What an entry's mark holds (bounded: a MAC is 64 hex digits); b"" if
        it cannot be read as a regular file."""
        try:
            refuse_linked(self.directory)
            fd = os.open(self.directory / entry_id, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                return os.read(fd, _MARK_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            finally:
                os.close(fd)
        except OSError:
            return b""

    def pending(self) -> list[str]:
        """Entry ids stored locally whose upload has not been acknowledged (an
        entry id is the only name the backlog holds)."""
        try:
            refuse_linked(self.directory)
            return sorted(n for n in os.listdir(self.directory) if ENTRY_ID.fullmatch(n))
        except OSError:
            return []
