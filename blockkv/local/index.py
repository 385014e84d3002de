"""The LMDB accelerator: what the files say, kept where it is fast to ask.

Five tables in one environment (``<fingerprint dir>/index/``):

- ``entries``: entry id → record (ns, header path, header bytes, block names,
  trim facts, checkpoint, tokens). Open and ``find`` never read a header.
- ``lastuse``: entry id → f64 last use (small, rewritten on every restore).
- ``blocks``: block name → (refcount u32, stored bytes u64, zero_since f64).
- ``pending``: entry id → the references a store took before its header
  became durable. A crash leaves a record here; recovery gives them back.
- ``log``: u64 sequence → ``+id`` / ``-id``: other processes replay it to keep
  their in-memory index current without re-reading the table.
- ``meta``: format version, boot id, last sequence, total bytes.

Nothing here is the truth: the header and block files are. The order of the
store's operations makes every crash leave refcounts too high (a leak that
``check(repair=True)`` reclaims), never too low. Transactions are not synced
(a process crash never loses a committed transaction); an OS crash can tear
what was not synced, so the tables are trusted across a boot only when they
were left settled: ``settle`` (under the directory lock) syncs them and then
writes ``index.settled`` beside ``index/``; every write transaction runs
under the lock once that file's removal is durable. After a reboot the file
proves the tables are what was last synced; without it they are rebuilt
(docs/design.md, "The LMDB accelerator").

Here: the tables, through a handle (``Index``) or read without the directory lock by
tools (``read_only_*``). The environment handles share is lmdb_env.py's; an
entry's row is packed by index_records.py.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from blockkv.errors import CorruptError
from blockkv.fs import TMP_SUFFIX, FileLayer
from blockkv.local.index_records import (
    gc_paused,
    pack_record,
    record_blocks,
    record_tokens,
    unpack_record,
    unpack_records,
)
from blockkv.local.lmdb_env import TXN_TIMEOUT, boot_id, env_key, open_env, release_env
from blockkv.local.prefix_index import TokensOf
from blockkv.local.txn_lock import TxnLock
from blockkv.records import EntryRecord, LocalChanges

# 2: writes only once ``index.settled`` is gone. A blockkv that knows nothing
# of it rebuilds these tables instead of writing into them, and this one
# rebuilds its own earlier tables (format 1), which it cannot prove settled.
FORMAT = b"blockkv-index-2"
SETTLED = "index.settled"  # beside index/: every committed write is durable and none followed
_BLOCK = struct.Struct("<IQd")
_BLOCK_ROW = np.dtype([("refs", "<u4"), ("size", "<u8"), ("zero_since", "<f8")])  # _BLOCK, packed
_U64 = struct.Struct(">Q")
_F64 = struct.Struct("<d")
_LOG_KEEP = 50_000
_NO_TOKENS = np.empty(0, np.uint32)
R = TypeVar("R")


@dataclass(frozen=True)
class BlockRow:
    refs: int
    size: int
    zero_since: float


class Index:
    """One fingerprint directory's tables, in the environment its process shares."""

    _DBS = (b"meta", b"entries", b"lastuse", b"blocks", b"pending", b"log")

    def __init__(self, path: Path, *, map_size: int = 256 << 20, fs: FileLayer | None = None) -> None:
        self.path = path
        self._fs = fs or FileLayer()
        self._boot = boot_id()
        self._settled = settled_marker(path)
        self._env = open_env(path, map_size, max_dbs=len(self._DBS), sync=not self._boot)
        try:
            (self._meta, self._entries, self._lastuse, self._blocks, self._pending, self._log) = (
                self._env.open_dbs(self._DBS))
        except BaseException:
            release_env(self._env)
            raise

    def close(self) -> None:
        release_env(self._env)

    def replaced(self) -> bool:
        """Whether ``index/`` on disk is no longer the environment we have open
        (an operator deleted it, or a rebuild moved a broken one aside): every
        handle asks before it trusts its view (docs/design.md, "Index epoch")."""
        try:
            return env_key(self.path) != self._env.key
        except OSError:
            return True

    # -- meta ---------------------------------------------------------------
    def is_trusted(self) -> bool:
        """Written by this format, and not across an OS crash we cannot see into:
        written in this boot, or settled (``settle``) since its last write."""

        def get(txn: lmdb.Transaction) -> tuple[bytes | None, bytes | None]:
            return txn.get(b"format", db=self._meta), txn.get(b"boot", db=self._meta)

        fmt, boot = self._env.read(get)
        return fmt == FORMAT and (boot == self._boot.encode() or os.path.lexists(self._settled))

    def dirty(self) -> bool:
        """Whether the tables may hold writes not yet synced: not settled
        (never, where there is no boot id: transactions are synced there)."""
        return bool(self._boot) and not os.path.lexists(self._settled)

    def settle(self) -> bool:
        """Under the directory lock: make every committed write durable, then
        say so durably (``index.settled``), so that after a reboot the tables
        are trusted as they are. False if there was nothing to settle. On a
        full disk the file cannot be written: the tables stay unsettled, and
        a reboot rebuilds them."""
        if not self.dirty():
            return False
        self._env.sync()
        for stale in self._settled.parent.glob(f".{SETTLED}.*{TMP_SUFFIX}"):  # a cut settle's
            self._fs.unlink_tmp(stale)
        self._fs.write_atomic(self._settled, [b"blockkv: the index was synced and nothing written since\n"])
        return True

    def _write(self, fn: Callable[[lmdb.Transaction], R]) -> R:
        """Every write transaction: under the directory lock, once the tables
        are durably not settled (no page of it can reach the disk before;
        an unlink needs no space, so this holds on a full disk), stamped
        with this boot's id."""
        if self._boot and os.path.lexists(self._settled):
            self._fs.unlink(self._settled)
            self._fs.fsync_dir(self._settled.parent)
        boot = self._boot.encode()

        def stamped(txn: lmdb.Transaction) -> R:
            if boot and txn.get(b"boot", db=self._meta) != boot:
                txn.put(b"boot", boot, db=self._meta)
            return fn(txn)

        return self._env.write(stamped)

    def position(self) -> tuple[bytes, int]:
        """(generation, log sequence): where a handle's view of the tables stands.
        The generation changes on every rebuild, so a handle never replays the
        log of one table set onto its view of another."""
        return self._env.read(lambda txn: (txn.get(b"gen", db=self._meta) or b"", _u64(txn.get(b"seq", db=self._meta))))

    def total_bytes(self) -> int:
        return self._env.read(lambda txn: _u64(txn.get(b"bytes", db=self._meta)))

    # -- reads --------------------------------------------------------------
    def entries(self, *, tokens: bool = True) -> list[EntryRecord]:
        """Every record, in the order they were added (their log sequence).
        ``tokens=False``: each with no tokens (an empty array), for who needs
        only the rest (recovery: many long entries' tokens are most of the table)."""

        def read(txn: lmdb.Transaction) -> list[EntryRecord]:
            records = _in_order(txn, self, 1 << 62, copy=tokens)
            return list(records) if tokens else [replace(r, tokens=_NO_TOKENS) for r in records]

        with gc_paused():
            return self._env.read(read, buffers=True)

    def scan_entries(self, fn: Callable[[EntryRecord, TokensOf], None], begin: Callable[[], None],
                     batch: int = 1024) -> None:
        """``fn(record, tokens_of)`` for every record in the order they were
        added, in one read transaction: the record's tokens, and what
        ``tokens_of`` returns, are views of the map, valid only inside the
        call (a load that holds no entry's tokens). ``begin()`` first, and
        again if the transaction is retried (the map resized): start over."""

        def read(txn: lmdb.Transaction) -> None:
            begin()
            def tokens_of(entry_id: str) -> np.ndarray | None:
                raw = txn.get(entry_id.encode(), db=self._entries)
                return record_tokens(raw) if raw is not None else None

            for record in _in_order(txn, self, batch):
                fn(record, tokens_of)

        with gc_paused():
            self._env.read(read, buffers=True)

    def rows_of(self, entry_ids: Iterable[str]) -> dict[str, tuple[np.ndarray, tuple[str, ...]]]:
        """The tokens (copied) and block names of each of ``entry_ids`` the table holds (one transaction)."""
        return self._parsed_rows(entry_ids, lambda raw: (record_tokens(raw).copy(), record_blocks(raw)))

    def blocks_of(self, entry_ids: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """The block names of each of ``entry_ids`` the table holds (one transaction)."""
        return self._parsed_rows(entry_ids, record_blocks)

    def _parsed_rows(self, entry_ids: Iterable[str], parse: Callable[[Any], R]) -> dict[str, R]:
        """``parse(row)`` of each of ``entry_ids`` the table holds, in one read
        transaction (the rows are views of the map: ``parse`` copies what it keeps)."""

        def read(txn: lmdb.Transaction) -> dict[str, R]:
            rows = ((entry_id, txn.get(entry_id.encode(), db=self._entries)) for entry_id in entry_ids)
            return {entry_id: parse(raw) for entry_id, raw in rows if raw is not None}

        return self._env.read(read, buffers=True)

    def entry(self, entry_id: str) -> EntryRecord | None:
        raw = self._env.read(lambda txn: txn.get(entry_id.encode(), db=self._entries))
        return unpack_record(entry_id, raw) if raw is not None else None

    def last_use(self) -> dict[str, float]:
        return self._env.read(
            lambda txn: {k.decode(): _F64.unpack(v)[0] for k, v in txn.cursor(db=self._lastuse)}
        )

    def blocks(self) -> dict[str, BlockRow]:
        with gc_paused():
            return self._env.read(
                lambda txn: {k.decode(): BlockRow(*_BLOCK.unpack(v)) for k, v in txn.cursor(db=self._blocks)}
            )

    def unreferenced(self, now: float, grace: float) -> tuple[int, bool]:
        """The bytes of the blocks no entry references, and whether any of them
        is outside its grace (older than ``grace``, or dated in the future):
        what every store's cap check asks. One pass over the rows as a numpy
        array, not an object each: at 10k entries (26k block rows) an object
        each cost 33 ms of CPU a store, this 4 ms (issue #45). Still a pass
        over every block row per store."""

        def read(txn: lmdb.Transaction) -> bytes:
            return b"".join(txn.cursor(db=self._blocks).iternext(keys=False, values=True))

        raw = self._env.read(read)
        if len(raw) % _BLOCK.size:  # a row of another size: read row by row, which says which
            rows = list(self.blocks().values())
            refs = np.array([r.refs for r in rows], np.uint32)
            size = np.array([r.size for r in rows], np.uint64)
            since = np.array([r.zero_since for r in rows], np.float64)
        else:
            table = np.frombuffer(raw, _BLOCK_ROW)
            refs, size, since = table["refs"], table["size"], table["zero_since"]
        zero = refs == 0
        since = since[zero]
        return int(size[zero].sum()), bool(np.any(~((now - grace < since) & (since <= now))))

    def block_sizes(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Stored sizes of the named blocks that have rows, or (``names`` None)
        of every block (one transaction)."""

        def read(txn: lmdb.Transaction) -> dict[str, int]:
            if names is None:
                return {k.decode(): _BLOCK.unpack(v)[1] for k, v in txn.cursor(db=self._blocks)}
            out = {}
            for name in names:
                raw = txn.get(name.encode(), db=self._blocks)
                if raw is not None:
                    out[name] = BlockRow(*_BLOCK.unpack(raw)).size
            return out

        return self._env.read(read)

    def block(self, name: str) -> BlockRow | None:
        raw = self._env.read(lambda txn: txn.get(name.encode(), db=self._blocks))
        return BlockRow(*_BLOCK.unpack(raw)) if raw is not None else None

    def changes_since(self, position: tuple[bytes, int]) -> tuple[tuple[bytes, int], list[tuple[str, str]]] | None:
        """(new position, [(op, id)...]) since ``position``; None when the log
        cannot get there (another generation, or trimmed past it): reload."""
        gen, seq = position

        def read(txn: lmdb.Transaction) -> tuple[tuple[bytes, int], list[tuple[str, str]]] | None:
            now_gen = txn.get(b"gen", db=self._meta) or b""
            last = _u64(txn.get(b"seq", db=self._meta))
            if now_gen != gen:
                return None
            if last == seq:
                return (gen, last), []
            floor = _u64(txn.get(b"log_floor", db=self._meta))
            if seq < floor or seq > last:
                return None
            cur = txn.cursor(db=self._log)
            ops = []
            if cur.set_range(_U64.pack(seq + 1)):
                for _, v in cur:
                    ops.append((chr(v[0]), v[1:].decode()))
            return (gen, last), ops

        return self._env.read(read)

    def changes(self, since: tuple[bytes, int] | None) -> LocalChanges:
        """``BlockStore.changes``: the records added and the ids removed since
        ``since`` (``changes_since``), or every record (``reset``) when the log
        cannot get there or ``since`` is None."""
        log = self.changes_since(since) if since is not None else None
        if log is None:
            position = self.position()  # first: a change made while we read is replayed next time
            return LocalChanges(position, True, tuple(self.entries()), ())
        position, ops = log
        added = [r for i in dict.fromkeys(i for op, i in ops if op == "+") if (r := self.entry(i)) is not None]
        return LocalChanges(position, False, tuple(added), tuple(i for op, i in ops if op == "-"))

    def pending(self) -> dict[str, dict[str, Any]]:
        return self._env.read(lambda txn: {k.decode(): json.loads(v) for k, v in txn.cursor(db=self._pending)})

    # -- mutations ------------------------------------------------------------
    def take_refs(self, entry_id: str, path: str, sizes: Mapping[str, int]) -> None:
        """Reference every block of a new entry, remembering it as pending."""

        def fn(txn: lmdb.Transaction) -> None:
            self._ref(txn, sizes)
            txn.put(
                entry_id.encode(), json.dumps({"path": path, "blocks": list(sizes)}).encode(), db=self._pending
            )

        self._write(fn)

    def add_entry(self, record: EntryRecord, last_use: float) -> int:
        """Make a durable header's entry visible; returns its log sequence."""

        def fn(txn: lmdb.Transaction) -> int:
            key = record.id.encode()
            txn.put(key, pack_record(record), db=self._entries)
            txn.put(key, _F64.pack(last_use), db=self._lastuse)
            txn.delete(key, db=self._pending)
            _add_bytes(txn, self._meta, record.header_bytes)
            return self._append_log(txn, b"+" + key)

        return self._write(fn)

    def add_scanned(self, record: EntryRecord, sizes: Mapping[str, int], last_use: float) -> int:
        """A header found on disk that the table did not know: reference and add it."""

        def fn(txn: lmdb.Transaction) -> int:
            self._ref(txn, sizes)
            key = record.id.encode()
            txn.put(key, pack_record(record), db=self._entries)
            txn.put(key, _F64.pack(last_use), db=self._lastuse)
            _add_bytes(txn, self._meta, record.header_bytes)
            return self._append_log(txn, b"+" + key)

        return self._write(fn)

    def _ref(self, txn: lmdb.Transaction, sizes: Mapping[str, int]) -> None:
        added = 0
        for name, size in sizes.items():
            row = _block(txn, self._blocks, name)
            refs = row.refs + 1 if row else 1
            if refs == 1:
                added += size
            txn.put(name.encode(), _BLOCK.pack(refs, size, 0.0), db=self._blocks)
        _add_bytes(txn, self._meta, added)

    def _unref(self, txn: lmdb.Transaction, names: Iterable[str], now: float) -> None:
        freed = 0
        for name in names:
            row = _block(txn, self._blocks, name)
            if row is None or row.refs == 0:
                continue  # already low: never go below zero
            refs = row.refs - 1
            if refs == 0:
                freed += row.size
            txn.put(name.encode(), _BLOCK.pack(refs, row.size, now if refs == 0 else 0.0), db=self._blocks)
        _add_bytes(txn, self._meta, -freed)

    def remove_entry(self, entry_id: str, now: float) -> EntryRecord | None:
        """Drop an entry whose header is already gone, and its references."""

        def fn(txn: lmdb.Transaction) -> EntryRecord | None:
            key = entry_id.encode()
            raw = txn.get(key, db=self._entries)
            if raw is None:
                return None
            record = unpack_record(entry_id, raw)
            txn.delete(key, db=self._entries)
            txn.delete(key, db=self._lastuse)
            self._unref(txn, dict.fromkeys(record.blocks), now)
            _add_bytes(txn, self._meta, -record.header_bytes)
            self._append_log(txn, b"-" + key)
            return record

        return self._write(fn)

    def rollback_pending(self, entry_id: str, now: float) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            raw = txn.get(entry_id.encode(), db=self._pending)
            if raw is not None:
                self._unref(txn, json.loads(raw)["blocks"], now)
                txn.delete(entry_id.encode(), db=self._pending)

        self._write(fn)

    def touch(self, uses: Mapping[str, float]) -> None:
        """Entries' last uses (id → when), each kept if later than the one recorded."""

        def fn(txn: lmdb.Transaction) -> None:
            for entry_id, when in uses.items():
                key = entry_id.encode()
                raw = txn.get(key, db=self._lastuse)
                if raw is not None and _F64.unpack(raw)[0] < when:
                    txn.put(key, _F64.pack(when), db=self._lastuse)

        self._write(fn)

    def drop_blocks(self, names: Iterable[str]) -> None:
        """Forget rows of blocks that gc deleted (only while still unreferenced)."""
        names = list(names)
        if not names:
            return  # no transaction: an open that swept nothing leaves a settled index settled

        def fn(txn: lmdb.Transaction) -> None:
            for name in names:
                row = _block(txn, self._blocks, name)
                if row is not None and row.refs == 0:
                    txn.delete(name.encode(), db=self._blocks)

        self._write(fn)

    def rebuild(self, records: Iterable[tuple[EntryRecord, float]], sizes: Mapping[str, int], now: float) -> None:
        """Replace every table with what the files say. Block files nothing
        references start their gc grace period now."""

        def fn(txn: lmdb.Transaction) -> None:
            old_seq = _u64(txn.get(b"seq", db=self._meta))  # the log's positions never repeat
            for db in (self._entries, self._lastuse, self._blocks, self._pending, self._log, self._meta):
                txn.drop(db, delete=False)
            txn.put(b"format", FORMAT, db=self._meta)
            txn.put(b"boot", self._boot.encode(), db=self._meta)
            txn.put(b"gen", os.urandom(16), db=self._meta)
            refs: dict[str, int] = {}
            total = 0
            seq = old_seq
            for record, last_use in records:
                key = record.id.encode()
                txn.put(key, pack_record(record), db=self._entries)
                txn.put(key, _F64.pack(last_use), db=self._lastuse)
                seq += 1
                txn.put(_U64.pack(seq), b"+" + key, db=self._log)
                total += record.header_bytes
                for name in dict.fromkeys(record.blocks):
                    refs[name] = refs.get(name, 0) + 1
            for name, size in sizes.items():
                n = refs.get(name, 0)
                txn.put(name.encode(), _BLOCK.pack(n, size, 0.0 if n else now), db=self._blocks)
                total += size if n else 0
            txn.put(b"seq", _U64.pack(seq), db=self._meta)
            txn.put(b"log_floor", _U64.pack(old_seq), db=self._meta)
            txn.put(b"bytes", _U64.pack(total), db=self._meta)

        self._write(fn)

    def trim_log(self) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            last = _u64(txn.get(b"seq", db=self._meta))
            floor = max(0, last - _LOG_KEEP)
            if floor <= _u64(txn.get(b"log_floor", db=self._meta)):
                return
            live = {k for k, _ in txn.cursor(db=self._entries)}
            cur = txn.cursor(db=self._log)
            cur.first()
            while cur.key() and _U64.unpack(cur.key())[0] <= floor:
                if cur.value()[1:] in live and cur.value()[:1] == b"+":
                    cur.next()  # keep the add record of a live entry: it orders the entries
                else:
                    cur.delete()
            txn.put(b"log_floor", _U64.pack(floor), db=self._meta)

        self._write(fn)

    def _append_log(self, txn: lmdb.Transaction, op: bytes) -> int:
        seq = _u64(txn.get(b"seq", db=self._meta)) + 1
        txn.put(_U64.pack(seq), op, db=self._log)
        txn.put(b"seq", _U64.pack(seq), db=self._meta)
        return seq


def _in_order(txn: lmdb.Transaction, index: Index, batch: int, *, copy: bool = False) -> Iterator[EntryRecord]:
    """The entries table's records in the order they were added (their last log
    record), ``batch`` rows parsed at a time; tokens are views of the rows
    unless ``copy``."""
    seqs = {bytes(v[1:]): bytes(k) for k, v in txn.cursor(db=index._log)}  # big-endian keys sort as numbers
    keys = sorted((bytes(k) for k in txn.cursor(db=index._entries).iternext(values=False)),
                  key=lambda k: seqs.get(k, b""))
    for at in range(0, len(keys), batch):
        chunk = keys[at : at + batch]
        yield from unpack_records([(k, txn.get(k, db=index._entries)) for k in chunk], copy=copy)


def _u64(raw: bytes | None) -> int:
    return _U64.unpack(raw)[0] if raw else 0


def _block(txn: lmdb.Transaction, db: Any, name: str) -> BlockRow | None:
    raw = txn.get(name.encode(), db=db)
    return BlockRow(*_BLOCK.unpack(raw)) if raw is not None else None


def _add_bytes(txn: lmdb.Transaction, meta: Any, delta: int) -> None:
    if delta:
        total = max(0, _u64(txn.get(b"bytes", db=meta)) + delta)
        txn.put(b"bytes", _U64.pack(total), db=meta)


def settled_marker(index_dir: Path) -> Path:
    """The file beside ``index_dir`` that is present only while its tables are
    settled (outside the environment's directory, which LMDB and whoever moves
    a broken environment aside own)."""
    return index_dir.with_name(SETTLED)


_SCAN_ROWS = 256  # rows a tool's scan reads per transaction: a writer waits for one such transaction at most


class _ReadOnlyEnv:
    """An index opened read-only for a tool, read in short transactions, each
    under the transaction lock shared: a writer waits for one of them at most
    (behind the turnstile, no new one starts), never for a whole scan. The
    scan is therefore not one committed state: rows added or removed while
    it runs may or may not be in it (the tools check every row against the
    files anyway); a rebuild meanwhile (a new generation) starts it again."""

    def __init__(self, env: lmdb.Environment, txns: TxnLock, gen: bytes) -> None:
        self._env, self._txns, self._gen = env, txns, gen

    def rows(self, name: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of table ``name``, ``_SCAN_ROWS`` per transaction."""
        for _ in range(3):
            out: list[tuple[bytes, bytes]] = []
            after: bytes | None = None
            while True:
                chunk = self._chunk(name, after)
                if chunk is None:
                    break  # another generation of the tables: from the start
                out += chunk
                if len(chunk) < _SCAN_ROWS:
                    return out
                after = chunk[-1][0]
        raise lmdb.Error("the index was rebuilt three times during one scan")

    def _chunk(self, name: bytes, after: bytes | None) -> list[tuple[bytes, bytes]] | None:
        with self._txns.shared(), self._env.begin() as txn:
            meta = self._env.open_db(b"meta", txn=txn, create=False)
            if (txn.get(b"gen", db=meta) or b"") != self._gen:
                return None
            cur = txn.cursor(db=self._env.open_db(name, txn=txn, create=False))
            found = cur.set_range(after) if after is not None else cur.first()
            if found and after is not None and cur.key() == after:
                found = cur.next()
            rows: list[tuple[bytes, bytes]] = []
            while found and len(rows) < _SCAN_ROWS:
                rows.append((cur.key(), cur.value()))
                found = cur.next()
            return rows


def _read_only(path: Path, fn: Callable[[_ReadOnlyEnv], R], *, this_boot: bool = False) -> R | None:
    """``fn`` over an index opened read-only (for tools that must change
    nothing), if it has our format (and, ``this_boot``, one a store would
    trust: written in this boot, or settled); None otherwise or if anything
    fails to parse. ``LockTimeout`` if the transaction lock stays busy (a
    stopped writer): busy is not "no index". It takes the lock from the data
    file opened read-only (this works on a read-only mount)."""
    if not (path / "data.mdb").is_file():
        return None
    try:
        txns = TxnLock(path, timeout=TXN_TIMEOUT, create=False)
    except OSError:
        return None
    try:
        with txns.shared():
            env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=len(Index._DBS))
    except BaseException as exc:
        txns.close()
        if isinstance(exc, lmdb.Error):
            return None
        raise
    try:
        gen = _trusted_gen(path, env, txns, this_boot)
        return None if gen is None else fn(_ReadOnlyEnv(env, txns, gen))
    except (lmdb.Error, CorruptError, struct.error, UnicodeDecodeError):
        return None
    finally:
        env.close()
        txns.close()


def _trusted_gen(path: Path, env: lmdb.Environment, txns: TxnLock, this_boot: bool) -> bytes | None:
    """The tables' generation, if they have our format (and, ``this_boot``, a store would trust them)."""
    with txns.shared(), env.begin() as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        if txn.get(b"format", db=meta) != FORMAT:
            return None
        boot = boot_id()
        rebooted = this_boot and boot and txn.get(b"boot", db=meta) != boot.encode()
        if rebooted and not os.path.lexists(settled_marker(path)):
            return None
        return txn.get(b"gen", db=meta) or b""


def read_only_block_rows(path: Path) -> dict[str, BlockRow] | None:
    """Block rows of an index, read without the directory lock; None if there
    is no usable index, ``LockTimeout`` if its lock stays busy."""

    def read(env: _ReadOnlyEnv) -> dict[str, BlockRow]:
        return {k.decode(): BlockRow(*_BLOCK.unpack(v)) for k, v in env.rows(b"blocks")}

    return _read_only(path, read)


def read_only_entries(path: Path) -> tuple[dict[str, EntryRecord], dict[str, float]] | None:
    """Entry rows and last-use times of an index a store would trust, read
    without the directory lock; None if it would not be trusted or does not
    parse, ``LockTimeout`` if its lock stays busy."""

    def read(env: _ReadOnlyEnv) -> tuple[dict[str, EntryRecord], dict[str, float]]:
        rows = env.rows(b"entries")
        uses = env.rows(b"lastuse")
        with gc_paused():
            records = unpack_records(rows)
        return {r.id: r for r in records}, {k.decode(): _F64.unpack(v)[0] for k, v in uses}

    return _read_only(path, read, this_boot=True)
