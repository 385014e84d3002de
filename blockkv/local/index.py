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
(a process crash never loses a committed transaction); after an OS crash the
boot id differs and the store rebuilds the tables from the files.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from blockkv.errors import CorruptError
from blockkv.records import EntryRecord

FORMAT = b"blockkv-index-1"
_BLOCK = struct.Struct("<IQd")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct("<d")
_LOG_KEEP = 50_000
# liblmdb errors that prove an environment broken (not a transient failure):
# only these move it aside to be rebuilt
BROKEN_INDEX = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.IncompatibleError,
                 lmdb.PageNotFoundError, lmdb.BadRslotError)
R = TypeVar("R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a bulk load. Loading 10k entries
    makes some 100k objects and no garbage cycles, yet triggers collections
    that walk the whole heap; in a big process (a server, the benchmark)
    those cost more than the load (an open at 10k entries: 360-390 ms
    without them, 475-775 ms with). Loads on several threads overlap: the
    last one out restores what the first one found (off stays off)."""
    global _gc_pauses, _gc_was_enabled
    with _gc_mutex:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_mutex:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


_gc_mutex = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


def boot_id() -> str:
    """Changes on every OS boot; '' where unknown (then transactions are synced)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class BlockRow:
    refs: int
    size: int
    zero_since: float


class Index:
    """One fingerprint directory's LMDB environment."""

    _DBS = (b"meta", b"entries", b"lastuse", b"blocks", b"pending", b"log")

    def __init__(self, path: Path, *, map_size: int = 256 << 20) -> None:
        self.path = path
        self._boot = boot_id()
        self._shared = _open_env(path, map_size, sync=not self._boot)
        self._env = self._shared.env
        (self._meta, self._entries, self._lastuse, self._blocks, self._pending, self._log) = (
            self._open_db(name) for name in self._DBS
        )

    def _open_db(self, name: bytes) -> Any:
        """Creating a table is a write: it may need the map to grow too."""
        while True:
            try:
                with self._shared.gate.shared():
                    return self._env.open_db(name)
            except lmdb.MapFullError:
                self._grow()

    def close(self) -> None:
        _release_env(self._shared)

    def replaced(self) -> bool:
        """Whether ``index/`` on disk is no longer the environment we have open
        (an operator deleted it, or a rebuild moved a broken one aside): every
        handle asks before it trusts its view (docs/design.md, "Index epoch")."""
        try:
            return _env_key(self.path) != self._shared.key
        except OSError:
            return True

    # -- transactions -------------------------------------------------------
    def _write(self, fn: Callable[[lmdb.Transaction], R]) -> R:
        """Run ``fn`` in a write transaction; grow the map when it is full."""
        while True:
            try:
                with self._shared.gate.shared(), self._env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_size()

    def _read(self, fn: Callable[[lmdb.Transaction], R]) -> R:
        while True:
            try:
                with self._shared.gate.shared(), self._env.begin() as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_size()

    def _grow(self) -> None:
        """Double the map, with no transaction of this process open (py-lmdb's rule)."""
        with self._shared.gate.exclusive():
            self._env.set_mapsize(self._env.info()["map_size"] * 2)

    def _adopt_size(self) -> None:
        """Another process grew the map: adopt its size, again with no transaction open."""
        with self._shared.gate.exclusive():
            self._env.set_mapsize(0)

    # -- meta ---------------------------------------------------------------
    def is_trusted(self) -> bool:
        """Written by this format, and not across an OS crash we cannot see into."""

        def get(txn: lmdb.Transaction) -> tuple[bytes | None, bytes | None]:
            return txn.get(b"format", db=self._meta), txn.get(b"boot", db=self._meta)

        fmt, boot = self._read(get)
        return fmt == FORMAT and boot == self._boot.encode()

    def position(self) -> tuple[bytes, int]:
        """(generation, log sequence): where a handle's view of the tables stands.
        The generation changes on every rebuild, so a handle never replays the
        log of one table set onto its view of another."""
        return self._read(lambda txn: (txn.get(b"gen", db=self._meta) or b"", _u64(txn.get(b"seq", db=self._meta))))

    def total_bytes(self) -> int:
        return self._read(lambda txn: _u64(txn.get(b"bytes", db=self._meta)))

    # -- reads --------------------------------------------------------------
    def entries(self) -> list[EntryRecord]:
        """Every record, in the order they were added (their log sequence)."""

        def read(txn: lmdb.Transaction) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]]]:
            seqs = {v[1:]: k for k, v in txn.cursor(db=self._log)}  # big-endian keys sort as numbers
            return seqs, list(txn.cursor(db=self._entries))

        with gc_paused():
            seqs, rows = self._read(read)
            rows.sort(key=lambda kv: seqs.get(kv[0], b""))
            return unpack_records(rows)

    def entry(self, entry_id: str) -> EntryRecord | None:
        raw = self._read(lambda txn: txn.get(entry_id.encode(), db=self._entries))
        return unpack_record(entry_id, raw) if raw is not None else None

    def last_use(self) -> dict[str, float]:
        return self._read(
            lambda txn: {k.decode(): _F64.unpack(v)[0] for k, v in txn.cursor(db=self._lastuse)}
        )

    def blocks(self) -> dict[str, BlockRow]:
        with gc_paused():
            return self._read(
                lambda txn: {k.decode(): BlockRow(*_BLOCK.unpack(v)) for k, v in txn.cursor(db=self._blocks)}
            )

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

        return self._read(read)

    def block(self, name: str) -> BlockRow | None:
        raw = self._read(lambda txn: txn.get(name.encode(), db=self._blocks))
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

        return self._read(read)

    def pending(self) -> dict[str, dict[str, Any]]:
        return self._read(lambda txn: {k.decode(): json.loads(v) for k, v in txn.cursor(db=self._pending)})

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
            txn.put(key, _pack_record(record), db=self._entries)
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
            txn.put(key, _pack_record(record), db=self._entries)
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

    def touch(self, entry_id: str, now: float) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            key = entry_id.encode()
            if txn.get(key, db=self._lastuse) is not None:
                txn.put(key, _F64.pack(now), db=self._lastuse)

        self._write(fn)

    def drop_blocks(self, names: Iterable[str]) -> None:
        """Forget rows of blocks that gc deleted (only while still unreferenced)."""

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
                txn.put(key, _pack_record(record), db=self._entries)
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


def _pack_record(record: EntryRecord) -> bytes:
    """An entry's row: a JSON head, then its tokens as little-endian u32."""
    meta = json.dumps(
        {
            "ns": record.ns,
            "path": record.path,
            "hdr": record.header_bytes,
            "blocks": list(record.blocks),
            "trim": record.trimmable,
            "mro": record.minimum_reusable_offset,
            "ckpt": record.checkpoint,
            "att": list(record.attachments),
            "owner": record.owner,
        },
        separators=(",", ":"),
    ).encode()
    return struct.pack("<I", len(meta)) + meta + np.ascontiguousarray(record.tokens, "<u4").tobytes()


def unpack_record(entry_id: str, data: bytes) -> EntryRecord:
    try:
        (n,) = struct.unpack_from("<I", data)
        return _record(entry_id, json.loads(data[4 : 4 + n]), data, 4 + n)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CorruptError(f"index record {entry_id} unreadable: {exc}") from None


def unpack_records(rows: list[tuple[bytes, bytes]]) -> list[EntryRecord]:
    """Every (key, value) row of the entries table as a record, in order. The
    JSON heads are parsed as one array (a third of the per-call cost of
    parsing 10k small documents one by one); if that fails, row by row, so
    the error names the row."""
    try:
        heads, ends = [], []
        for _, v in rows:
            (n,) = struct.unpack_from("<I", v)
            heads.append(v[4 : 4 + n])
            ends.append(4 + n)
        metas = json.loads(b"[" + b",".join(heads) + b"]")
        if len(metas) != len(rows):
            raise ValueError("a head is not one JSON value")
        return [_record(k.decode(), m, v, end) for (k, v), m, end in zip(rows, metas, ends)]
    except (ValueError, KeyError, TypeError, struct.error):
        return [unpack_record(k.decode(), v) for k, v in rows]


def _record(entry_id: str, m: Any, data: bytes, offset: int) -> EntryRecord:
    return EntryRecord(
        entry_id, m["ns"], m["path"], int(m["hdr"]), tuple(m["blocks"]), bool(m["trim"]),
        int(m["mro"]), m["ckpt"], tuple(m["att"]), str(m["owner"]),
        np.frombuffer(data, "<u4", offset=offset).copy(),
    )


def _u64(raw: bytes | None) -> int:
    return _U64.unpack(raw)[0] if raw else 0


def _block(txn: lmdb.Transaction, db: Any, name: str) -> BlockRow | None:
    raw = txn.get(name.encode(), db=db)
    return BlockRow(*_BLOCK.unpack(raw)) if raw is not None else None


def _add_bytes(txn: lmdb.Transaction, meta: Any, delta: int) -> None:
    if delta:
        total = max(0, _u64(txn.get(b"bytes", db=meta)) + delta)
        txn.put(b"bytes", _U64.pack(total), db=meta)


class _Gate:
    """Readers-writer lock over one environment's transactions: any number of
    transactions, or one map resize with none open (py-lmdb forbids resizing
    while another thread of the process is inside a transaction)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing or self._active:
                self._cond.wait()
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


@dataclass
class _SharedEnv:
    env: lmdb.Environment
    key: tuple[int, int]  # (st_dev, st_ino) of data.mdb when opened
    gate: _Gate
    users: int = 1


# LMDB forbids opening one environment twice in a process; handles share one.
_ENVS: dict[tuple[str, int, int], _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _env_key(path: Path) -> tuple[int, int]:
    st = os.stat(path / "data.mdb")
    return (st.st_dev, st.st_ino)


def _open_env(path: Path, map_size: int, *, sync: bool) -> _SharedEnv:
    resolved = str(path.resolve())
    with _ENVS_LOCK:
        try:
            key = _env_key(path)
        except FileNotFoundError:
            key = None
        if key is not None and (resolved, *key) in _ENVS:
            shared = _ENVS[(resolved, *key)]
            shared.users += 1
            return shared
        # liblmdb refuses a second environment on one lock file: one whose data
        # file was replaced in place is dead. Close it once no transaction is
        # inside it; its handles get an error and reopen (``Index.replaced``).
        for stale in [v for k, v in _ENVS.items() if k[0] == resolved]:
            with stale.gate.exclusive():
                stale.env.close()
            for k in [k for k, v in _ENVS.items() if v is stale]:
                del _ENVS[k]
        path.mkdir(mode=0o700, exist_ok=True)
        env = lmdb.open(
            str(path), map_size=map_size, max_dbs=len(Index._DBS), max_readers=1024,
            sync=sync, metasync=sync, readahead=False, mode=0o600,
        )
        env.reader_check()
        key = _env_key(path)
        shared = _ENVS[(resolved, *key)] = _SharedEnv(env, key, _Gate())
        return shared


def _release_env(shared: _SharedEnv) -> None:
    """Close the environment once its last handle lets go."""
    with _ENVS_LOCK:
        shared.users -= 1
        if shared.users:
            return
        for k, v in list(_ENVS.items()):
            if v is shared:
                del _ENVS[k]
        shared.env.close()  # a no-op if it was closed as stale


def _read_only(path: Path, fn: Callable[[lmdb.Environment, lmdb.Transaction], R], *,
               this_boot: bool = False) -> R | None:
    """``fn`` over an index opened read-only without its lock file (for tools
    that must change nothing), if it has our format (and, ``this_boot``, was
    written since this boot: one a store would trust); None otherwise, or if
    anything fails to parse. Without the lock a writer may reuse pages under
    us, so garbage is possible and reads as "no usable index"."""
    if not (path / "data.mdb").is_file():
        return None
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=len(Index._DBS))
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            if txn.get(b"format", db=meta) != FORMAT:
                return None
            if this_boot and txn.get(b"boot", db=meta) != boot_id().encode():
                return None
            return fn(env, txn)
    except (lmdb.Error, CorruptError, struct.error, UnicodeDecodeError):
        return None
    finally:
        env.close()


def read_only_block_rows(path: Path) -> dict[str, BlockRow] | None:
    """Block rows of an index, read without its lock; None if there is no usable index."""

    def read(env: lmdb.Environment, txn: lmdb.Transaction) -> dict[str, BlockRow]:
        blocks = env.open_db(b"blocks", txn=txn, create=False)
        return {k.decode(): BlockRow(*_BLOCK.unpack(v)) for k, v in txn.cursor(db=blocks)}

    return _read_only(path, read)


def read_only_entries(path: Path) -> tuple[dict[str, EntryRecord], dict[str, float]] | None:
    """Entry rows and last-use times of an index a store would trust, read
    without its lock; None if it would not be trusted or does not parse."""

    def read(env: lmdb.Environment, txn: lmdb.Transaction) -> tuple[dict[str, EntryRecord], dict[str, float]]:
        entries = env.open_db(b"entries", txn=txn, create=False)
        rows = {k.decode(): unpack_record(k.decode(), v) for k, v in txn.cursor(db=entries)}
        lastuse = env.open_db(b"lastuse", txn=txn, create=False)
        return rows, {k.decode(): _F64.unpack(v)[0] for k, v in txn.cursor(db=lastuse)}

    return _read_only(path, read, this_boot=True)
