"""What a store's remote tier keeps on the local disk, beside the fingerprint
directory (remote.py): copies of the bucket's headers, and the backlog of
stores the bucket has not acknowledged. Neither is fsynced: a copy lost or
torn by a power cut fails its checksum or is missing and is fetched again; a
backlog marker lost leaves its entry local-only."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from blockkv.errors import CorruptError
from blockkv.format.header import Header
from blockkv.fs import DIR_MODE, FILE_MODE, FileLayer, refuse_linked
from blockkv.local.directory import verified_header

_UUID = re.compile(r"[0-9a-f]{32}")  # an entry id: the only name the backlog holds


class HeaderCache:
    """``remote-headers/<ns dir>/<uuid>.bkv``: copies of the bucket's headers
    (immutable, checksummed), so a node that restarts reads the remote
    catalog from its disk and fetches only headers new to it."""

    def __init__(self, directory: Path, fs: FileLayer, warn: Callable[[str, str], None]) -> None:
        self.directory = directory
        self._fs = fs
        self._warn = warn

    def get(self, names: list[str]) -> dict[str, tuple[bytes, Header]]:
        """The headers of ``names`` the cache holds, verified; a damaged copy is removed."""
        found = {}
        for name in names:
            path = self.directory / name
            try:
                data = self._fs.read(path)
                found[name] = (data, verified_header(name, data))
            except CorruptError:
                self.drop([name])
            except (OSError, MemoryError):
                continue  # not cached (or unreadable now): fetched
        return found

    def keep(self, fetched: Mapping[str, tuple[bytes, Header]]) -> None:
        """Cache fetched headers: tmp then rename, no fsync (a copy lost or torn
        by a power cut fails its checksum or is missing, and is fetched again)."""
        try:
            refuse_linked(self.directory)
            for name, (data, _) in fetched.items():
                path = self.directory / name
                refuse_linked(path.parent)
                os.makedirs(path.parent, DIR_MODE, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
                with open(fd, "wb") as f:
                    f.write(data)
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
    """``backlog/<entry id>``: an empty file per store whose upload the bucket
    has not acknowledged, for a later sync to send."""

    def __init__(self, directory: Path, warn: Callable[[str, str], None]) -> None:
        self.directory = directory
        self._warn = warn

    def mark(self, entry_id: str) -> None:
        """Put an entry in the backlog before its upload (an empty file, not
        fsynced: a power cut may lose it, and the entry then stays local-only)."""
        try:
            refuse_linked(self.directory)
            if not self.directory.is_dir():
                os.makedirs(self.directory, DIR_MODE, exist_ok=True)
            os.close(os.open(self.directory / entry_id, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             FILE_MODE))
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

    def pending(self) -> list[str]:
        """Entry ids stored locally whose upload has not been acknowledged."""
        try:
            refuse_linked(self.directory)
            return sorted(n for n in os.listdir(self.directory) if _UUID.fullmatch(n))
        except OSError:
            return []
