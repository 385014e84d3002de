"""Look at a fingerprint directory without changing it.

``blockkv ls``, ``stats`` and ``check`` only look, so they must never write,
rename, unlink or take the directory lock — not even when the index is lost or
a header is corrupt, where opening a ``BlockStore`` would rebuild the index and
delete what it cannot read. This reader lists the files (the truth), parses
every header, stats the blocks they reference, and takes last-use times from
the LMDB index opened read-only without a lock file when the index is one a
store would trust; otherwise from each header's write time, which is what a
store rebuilding its index would use.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import lmdb

from blockkv import Entry, GenerationCheckpoint
from blockkv.directory import Directory, read_identity
from blockkv.errors import CorruptError
from blockkv.fs import FileLayer
from blockkv.header import Identity
from blockkv.index import FORMAT, boot_id

_LAST_USE = struct.Struct("<d")  # the index's lastuse table: f64 seconds per entry id
_MAX_DBS = 16  # an upper bound on the index's named tables (lmdb needs one to open them)


@dataclass(frozen=True)
class DirectoryView:
    """What one fingerprint directory holds, as the files say."""

    identity: Identity  # from IDENTITY: whose entries are served from here
    entries: list[Entry]  # this identity's servable entries, in no particular order
    foreign: Counter[Identity]  # entries of other identities sharing the directory: kept, never served
    corrupt_headers: list[str]  # relative paths; a store would delete these on open
    dangling: list[str]  # entry ids missing a block; a store would delete these on open
    disk_bytes: int  # headers plus each referenced block once (what the store calls total_bytes)
    blocks: int  # distinct blocks referenced
    index_used: bool  # last-use times came from a trusted index

    @property
    def logical_bytes(self) -> int:
        """What one self-contained file per entry would take (no sharing)."""
        return sum(e.nbytes for e in self.entries)


def read_directory(path: Path) -> DirectoryView:
    """A read-only view of the fingerprint directory at ``path``."""
    identity = read_identity(path)
    directory = Directory(path, identity, FileLayer())
    listing = directory.listing()
    last_use = index_last_use(directory.index_dir)
    own = identity.digest()
    entries: list[Entry] = []
    foreign: Counter[Identity] = Counter()
    corrupt: list[str] = []
    dangling: list[str] = []
    header_bytes = 0
    referenced: set[str] = set()
    sizes: dict[str, int] = {}
    for entry_id, p in sorted(listing.headers.items()):
        header_path = Path(p)
        try:
            header = directory.read_header(header_path)
            stat = header_path.stat()
        except FileNotFoundError:
            continue  # removed while we looked
        except (CorruptError, OSError):
            corrupt.append(directory.rel(header_path))
            continue
        record = directory.record(entry_id, header_path, header, stat.st_size)
        if record.owner == own and any(n not in listing.blocks for n in record.blocks):
            dangling.append(entry_id)
            continue
        header_bytes += record.header_bytes
        referenced.update(n for n in record.blocks if n in listing.blocks)
        for name in record.blocks:
            if name not in sizes and name in listing.blocks:
                sizes[name] = _block_size(directory, name)
        if record.owner != own:
            foreign[header.identity] += 1
            continue
        used = last_use.get(entry_id) if last_use is not None else None
        entries.append(
            Entry(
                id=entry_id, ns=record.ns, token_array=record.tokens,
                nbytes=record.header_bytes + sum(sizes.get(n, 0) for n in record.blocks),
                header_bytes=record.header_bytes, blocks=record.blocks,
                last_use=stat.st_mtime if used is None else used,
                trimmable=record.trimmable, minimum_reusable_offset=record.minimum_reusable_offset,
                checkpoint=GenerationCheckpoint.from_json(record.checkpoint) if record.checkpoint else None,
                attachments=record.attachments,
            )
        )
    return DirectoryView(
        identity=identity, entries=entries, foreign=foreign, corrupt_headers=corrupt, dangling=dangling,
        disk_bytes=header_bytes + sum(sizes[n] for n in referenced), blocks=len(referenced),
        index_used=last_use is not None,
    )


def _block_size(directory: Directory, name: str) -> int:
    try:
        return directory.pool.stat(name).size
    except FileNotFoundError:
        return 0


def index_last_use(index_dir: Path) -> dict[str, float] | None:
    """Last-use times from an index a store would trust (its format, this
    boot), opened read-only and without a lock file; None otherwise."""
    if not (index_dir / "data.mdb").is_file():
        return None
    try:
        env = lmdb.open(str(index_dir), readonly=True, lock=False, max_dbs=_MAX_DBS)
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            if txn.get(b"format", db=meta) != FORMAT or txn.get(b"boot", db=meta) != boot_id().encode():
                return None
            table = env.open_db(b"lastuse", txn=txn, create=False)
            return {k.decode(): _LAST_USE.unpack(v)[0] for k, v in txn.cursor(db=table)}
    except (lmdb.Error, struct.error, UnicodeDecodeError):
        return None
    finally:
        env.close()
