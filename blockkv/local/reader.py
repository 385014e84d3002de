"""Look at a fingerprint directory without changing it.

``blockkv ls`` and ``stats`` only look (as ``check`` does through
``directory_check.inspect_directory``), so they must never write, rename,
unlink or take the directory lock — not even when the index is lost or a header is corrupt, where opening a
``BlockStore`` would rebuild the index and delete what it cannot read. This reader lists the files (the truth) and stats
the blocks the entries reference. When the LMDB index is one a store would
trust (its format, this boot) it is opened read-only (its transaction lock
taken shared, from the files opened read-only, a few hundred rows at a time),
and its rows stand in for the headers it lists, with their last-use times, as
they do for a store opening the directory; every other header is read and
verified, and its write time is its last use, as for a store rebuilding its
index. An index whose lock stays busy (a writer stopped inside a
transaction) is passed over: the files alone answer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from blockkv.errors import CorruptError, LockTimeout
from blockkv.format.header import Identity
from blockkv.fs import FileLayer
from blockkv.local.directory import Directory, read_identity
from blockkv.local.index import read_only_entries
from blockkv.records import Entry, EntryRecord


@dataclass(frozen=True)
class DirectoryView:
    """What one fingerprint directory holds, as the files say."""

    identity: Identity  # from IDENTITY: whose entries are served from here
    entries: list[Entry]  # this identity's servable entries, of either mode, in no particular order
    foreign: Counter[Identity]  # entries of other identities sharing the directory: kept, never served
    corrupt_headers: list[str]  # relative paths; a store would delete these on open
    dangling: list[str]  # entry ids missing a block; a store would delete these on open
    blocks: int  # distinct blocks referenced, of every identity
    index_used: bool  # a trusted index stood in for the headers it lists
    records: list[EntryRecord]  # the servable entries' records, for a catalog (``ReadOnlyStore``)
    block_sizes: dict[str, int]  # every block the entries reference, by its file's size

    @property
    def logical_bytes(self) -> int:
        """What one self-contained file per entry would take (no sharing)."""
        return sum(e.nbytes for e in self.entries)


def read_directory(path: Path) -> DirectoryView:
    """A read-only view of the fingerprint directory at ``path``."""
    identity = read_identity(path)
    directory = Directory(path, identity, FileLayer())
    listing = directory.listing()
    try:
        indexed = read_only_entries(directory.index_dir)
    except LockTimeout:  # a stopped writer holds the index: the files alone still answer
        indexed = None
    rows, last_use = indexed if indexed is not None else ({}, {})
    own = directory.modes  # an entry stored with isolate_namespaces (--per-key-cache) is ours too
    entries: list[Entry] = []
    records: list[EntryRecord] = []
    foreign: Counter[Identity] = Counter()
    corrupt: list[str] = []
    dangling: list[str] = []
    sizes: dict[str, int] = {}  # every block referenced, by its file's size
    for entry_id, p in sorted(listing.headers.items()):
        header_path = Path(p)
        record = rows.get(entry_id)
        try:
            st = header_path.stat()  # its mtime is the entry's last use (a restore's not yet in the index too)
            if record is None or record.owner not in own:  # a foreign row does not name its owner
                header = directory.read_header(header_path)
                record = directory.record(entry_id, header_path, header, st.st_size)
                if record.owner not in own:
                    if not any(n not in listing.blocks for n in record.blocks):
                        foreign[header.identity] += 1
                    sizes.update((n, _block_size(directory, n)) for n in record.blocks if n in listing.blocks)
                    continue
            last_use[entry_id] = max(last_use.get(entry_id, 0.0), st.st_mtime)
        except FileNotFoundError:
            continue  # removed while we looked
        except (CorruptError, OSError):
            corrupt.append(directory.rel(header_path))
            continue
        if any(n not in listing.blocks for n in record.blocks):
            dangling.append(entry_id)
            continue
        sizes.update((n, _block_size(directory, n)) for n in record.blocks if n not in sizes)
        records.append(record)
        entries.append(Entry.of(record, record.header_bytes + sum(sizes[n] for n in record.blocks),
                                last_use.get(entry_id, 0.0)))
    return DirectoryView(
        identity=identity, entries=entries, foreign=foreign, corrupt_headers=corrupt, dangling=dangling,
        blocks=len(sizes), index_used=indexed is not None,
        records=records, block_sizes=sizes,
    )


def _block_size(directory: Directory, name: str) -> int:
    try:
        return directory.pool.stat(name).size
    except FileNotFoundError:
        return 0


