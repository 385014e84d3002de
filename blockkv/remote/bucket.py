"""One fingerprint directory in an S3-compatible bucket, shared by a fleet of nodes.

The mechanism of issue #14 that a store calls (docs/scale-out.md): uploads in
the write order (blocks, then the header as the commit point), header listings
by which a node learns what others wrote, verified concurrent block fetches,
fleet-wide LRU eviction, and mark-and-sweep GC with a grace period that needs
no coordinator. Every time compared is the server's (``Last-Modified``),
never a local wall clock; local monotonic time only paces waits that end
in a fresh look at the server's clock.

Every bucket request has a bounded timeout; any failure that is not a
definite answer (missing, corrupt, bad argument) is raised as
``BucketError``, so the store has one exception to turn into "not stored" /
"no hit".
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from blockkv.errors import BlockKVError, BlockMissingError, CorruptBlockError, CorruptError, NewerFormatError
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import decode_block
from blockkv.format.header import Header, Identity, decode_header
from blockkv.fs import Buffer
from blockkv.local.directory import HEADER_LAYOUT, verified_header
from blockkv.pool.protocol import BLOCK_LAYOUT, Layout
from blockkv.pool.s3 import S3Pool

try:
    import obstore
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("blockkv.remote.bucket needs obstore: pip install 'blockkv[s3]'") from exc

_HEX32 = r"[0-9a-f]{32}"
# the fingerprint directory's own objects: IDENTITY, MANIFEST (headers packed in one
# object: an accelerator for a node's open, remote.py), a node's clock probe, GC
# run markers and per-entry last-use marks (``used/<header name>``)
META_LAYOUT = Layout(re.compile(rf"IDENTITY|MANIFEST|clock/{_HEX32}|gc/{_HEX32}(\.done)?|used/{HEADER_LAYOUT.pattern.pattern}"),
                     sharded=False)
# Last-Modified has one-second resolution (an HTTP date): every comparison of
# server times gives this much away, always in the safe direction
CLOCK_SLACK = 1.0


class BucketError(BlockKVError):
    """The bucket is unreachable, slow or refusing requests (not a definite answer)."""


class StoreTooSlow(BucketError):
    """A store outlasted its deadline under the grace period: its header was not written."""


@contextmanager
def _outage(what: str) -> Iterator[None]:
    """Definite answers pass through; everything else the client raises is an outage."""
    try:
        yield
    except (BlockMissingError, FileNotFoundError, CorruptError, ValueError, TypeError, BucketError):
        raise
    except Exception as exc:  # noqa: BLE001 - obstore raises many types for one meaning
        first_line = str(exc).strip().partition("\n")[0]  # obstore appends pages of debug detail
        raise BucketError(f"bucket {what} failed: {first_line}") from exc


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    last_modified: float  # server time, seconds since the epoch


class _Pool(S3Pool):
    """S3Pool plus what only the bucket protocol needs: overwrite (a refresh
    resets Last-Modified) and listings that carry size and Last-Modified."""

    def put_overwrite(self, name: str, parts: Sequence[Buffer]) -> None:
        key = self.layout.location(self.layout.check(name))
        obstore.put(self._store, key, b"".join(parts), mode="overwrite", use_multipart=False)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        wanted = self.layout.location_prefix(prefix)
        directory = wanted.rpartition("/")[0]
        for batch in obstore.list(self._store, prefix=directory or None, chunk_size=1000):
            for meta in batch:
                name = self.layout.name_of(meta["path"])
                if name is not None and meta["path"].startswith(wanted):
                    yield ObjectInfo(name, meta["size"], meta["last_modified"].timestamp())

    def last_modified(self, name: str) -> float:
        return self.stat(name).mtime

    def delete_many(self, names: Sequence[str]) -> None:
        if names:
            obstore.delete(self._store, [self.layout.location(n) for n in names])


@dataclass
class GcReport:
    headers: int = 0  # roots seen
    blocks: int = 0  # blocks listed
    deleted: list[str] = field(default_factory=list)
    young: int = 0  # unreferenced but kept (inside the grace period, or nothing swept)
    stopped_early: bool = False  # the sweep window closed before every candidate went
    unreadable_headers: list[str] = field(default_factory=list)  # while any exists, nothing is swept


@dataclass
class GcPlan:
    """What a GC run's mark phase condemned, for its sweep."""

    marker: str
    start: float  # server time the run began (its marker's Last-Modified)
    doomed: list[str]
    roots: set[str]  # header names listed after the marker
    report: GcReport


class Bucket:
    """``<url>/<fingerprint dir>/``: blocks, headers, IDENTITY and the protocol's marks.

    ``grace`` (seconds of server time) must exceed twice the longest store: a
    store whose first block check to header takes more than ``grace/2 -
    request_bound - 2 s`` is re-checked once and then refused. ``sweep_window``
    bounds how long after it starts a GC run may still delete; a writer whose
    store overlaps a run waits for it (at most that long) and checks its blocks
    again. docs/scale-out.md ("GC across nodes") has the protocol and its proof."""

    def __init__(self, url: str, fingerprint_dir: str, options: Mapping[str, str] | None = None, *,
                 grace: float = 3600.0, sweep_window: float = 60.0, timeout: float = 10.0,
                 connect_timeout: float = 3.0, max_retries: int = 1, fetch_threads: int = 8,
                 touch_interval: float = 60.0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", fingerprint_dir or ""):
            raise ValueError(f"{fingerprint_dir!r} is not a fingerprint directory name")
        if timeout <= 0 or max_retries < 0:
            raise ValueError("timeout must be positive and max_retries at least 0")
        # the longest one request can take, retries included (each attempt starts within `timeout`)
        self.request_bound = timeout * (max_retries + 1)
        if sweep_window <= self.request_bound + CLOCK_SLACK:
            raise ValueError("sweep_window must exceed timeout * (max_retries + 1) + 1 s (a GC's last delete fits in it)")
        if grace / 2 <= self.request_bound + 2 * CLOCK_SLACK:
            raise ValueError("grace/2 must exceed timeout * (max_retries + 1) + 2 s (a store must fit under it)")
        if fetch_threads < 1:
            raise ValueError("fetch_threads must be at least 1")
        base = f"{url.rstrip('/')}/{fingerprint_dir}"
        config = dict(options=options, timeout=timeout, connect_timeout=connect_timeout, max_retries=max_retries)
        self.url = base
        self.blocks = _Pool(f"{base}/blobs", BLOCK_LAYOUT, **config)
        self.headers = _Pool(f"{base}/entries", HEADER_LAYOUT, **config)
        self.meta = _Pool(base, META_LAYOUT, **config)
        self.grace = grace
        self.sweep_window = sweep_window
        self.touch_interval = touch_interval
        self._node = uuid.uuid4().hex  # this handle's clock probe object
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="blockkv-bucket")
        self._header_blocks: dict[str, tuple[str, ...] | None] = {}  # headers are immutable: read each once
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    # -- time -----------------------------------------------------------------
    def server_now(self) -> float:
        """The server's clock: Last-Modified of an object this handle just wrote."""
        name = f"clock/{self._node}"
        with _outage("clock probe"):
            self.meta.put_overwrite(name, [b""])
            return self.meta.last_modified(name)

    # -- identity -------------------------------------------------------------
    def ensure_identity(self, identity: Identity) -> None:
        """Create IDENTITY, or check that the one there names the same model and tokenizer."""
        body = {"format": 1, "model_id": identity.model_id, "config_fingerprint": identity.config_fingerprint,
                "tokenizer_hash": identity.tokenizer_hash}
        with _outage("IDENTITY"):
            if self.meta.put_if_absent("IDENTITY", [json.dumps(body, indent=1).encode()]):
                return
            try:
                found = json.loads(self.meta.get("IDENTITY"))
                same = all(found[k] == body[k] for k in ("model_id", "config_fingerprint", "tokenizer_hash"))
            except (ValueError, KeyError, TypeError):
                same = False
        if not same:
            raise ValueError(f"{self.url}/IDENTITY names another model or tokenizer")

    # -- the manifest (an accelerator, never needed for correctness) ----------
    def get_manifest(self) -> bytes | None:
        """The MANIFEST some node wrote last, or None. Untrusted like every object."""
        try:
            with _outage("manifest"):
                return self.meta.get("MANIFEST")
        except BlockMissingError:
            return None

    def put_manifest(self, data: bytes) -> None:
        with _outage("manifest"):
            self.meta.put_overwrite("MANIFEST", [data])

    # -- writing --------------------------------------------------------------
    def begin_store(self) -> StoreSession:
        """Start a store: takes the server time its freshness rules are measured from."""
        return StoreSession(self, self.server_now())

    # -- reading --------------------------------------------------------------
    def list_headers(self, ns_dir: str = "") -> dict[str, ObjectInfo]:
        """Every header (of one namespace directory when given): the fleet's committed entries."""
        with _outage("header listing"):
            return {i.name: i for i in self.headers.list_info(f"{ns_dir}/" if ns_dir else "")}

    def new_headers(self, known: Iterable[str]) -> list[str]:
        """Headers not in ``known`` (a previous listing or the local index), oldest first."""
        known = set(known)
        listed = self.list_headers()
        return sorted((n for n in listed if n not in known), key=lambda n: (listed[n].last_modified, n))

    def fetch_header(self, name: str) -> tuple[bytes, Header]:
        """A header's bytes and what they say, verified (checksum, bounds, descriptor)."""
        with _outage(f"fetch of header {name}"):
            data = self.headers.get(name)
        return data, verified_header(name, data)

    def fetch_headers(self, names: Iterable[str]) -> tuple[dict[str, tuple[bytes, Header]], list[str]]:
        """Many headers at once, concurrently (a node's open): (verified headers,
        names of damaged ones). A header gone since it was listed is left out;
        an outage raises BucketError. Nothing here deletes a damaged one: a
        later format's header looks the same to this version."""

        def read(name: str) -> tuple[str, tuple[bytes, Header] | None]:
            try:
                return name, self.fetch_header(name)
            except BlockMissingError:
                return name, ()  # evicted since it was listed: left out
            except (CorruptError, NewerFormatError):
                return name, None  # damaged, or a later format: never served, never deleted

        found, damaged = {}, []
        for name, result in self._fetchers.map(read, list(dict.fromkeys(names))):
            if result is None:
                damaged.append(name)
            elif result:
                found[name] = result
        return found, damaged

    def fetch_block(self, name: str, key: bytes | None = None) -> bytes:
        """A block's frame, verified against its name (``key``: the namespace key
        it was named with, ``blocks.block_key``). A frame that does not hash
        to its name is proof of damage: it is deleted from the bucket (unless it
        changed meanwhile) so the next store of the block uploads a good copy."""
        with _outage(f"fetch of block {name}"):
            data = self.blocks.get(name)
        try:
            decode_block(name, data, key=key)
        except CorruptBlockError:
            self._quarantine(name, data)
            raise
        return data

    def submit_fetches(self, names: Iterable[str], key: bytes | None = None) -> dict[str, Future[bytes]]:
        """Start fetching ``names`` concurrently: a future of each verified frame
        (for a caller that uses each block as it arrives)."""
        return {n: self._fetchers.submit(self.fetch_block, n, key) for n in dict.fromkeys(names)}

    def fetch_blocks(self, names: Iterable[str], key: bytes | None = None) -> dict[str, bytes]:
        """Verified frames of ``names``, fetched concurrently. Raises
        BlockMissingError / CorruptBlockError for the first bad one (a miss),
        BucketError on an outage."""
        futures = self.submit_fetches(names, key)
        try:
            return {n: f.result() for n, f in futures.items()}
        finally:
            for f in futures.values():
                f.cancel()

    def _quarantine(self, name: str, data: bytes) -> None:
        try:
            with _outage("quarantine"):
                if self.blocks.get(name) == data:  # not replaced by a good copy since we read it
                    self.blocks.delete(name)
        except (BucketError, BlockMissingError):
            pass  # the next reader finds it damaged again

    def touch(self, header_name: str) -> None:
        """Record a use of an entry where every node sees it (``used/<header>``'s
        Last-Modified), at most once per ``touch_interval`` per entry and handle."""
        HEADER_LAYOUT.check(header_name)
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(header_name, -self.touch_interval) < self.touch_interval:
                return
            self._touched[header_name] = now
        with _outage("touch"):
            self.meta.put_overwrite(f"used/{header_name}", [b""])

    # -- deleting ---------------------------------------------------------------
    def _blocks_of(self, names: Iterable[str]) -> dict[str, tuple[str, ...] | None]:
        """Block names each header references (cached: headers never change).
        A header that is gone is left out; one that cannot be read maps to None
        (damaged, or of a format this version does not know: its blocks are unknown)."""
        names = list(names)
        found, damaged = self.fetch_headers(n for n in names if n not in self._header_blocks)
        for name in damaged:
            self._header_blocks[name] = None
        for name, (_, header) in found.items():
            refs = blocks_for_prefix(header.descriptor, None)
            self._header_blocks[name] = tuple(dict.fromkeys(r.name for r in refs))
        return {n: self._header_blocks[n] for n in names if n in self._header_blocks}

    def gc(self) -> GcReport:
        """One mark-and-sweep run (safe beside any number of writers and other runs)."""
        return self.gc_sweep(self.gc_mark())

    def gc_mark(self) -> GcPlan:
        """Mark: write this run's marker (its Last-Modified is the run's start);
        headers listed after it are the roots; condemn blocks no root references
        whose Last-Modified is more than ``grace`` before the start."""
        self._blocks_of(self.list_headers())  # the slow part (reading headers) before the window opens
        marker = f"gc/{uuid.uuid4().hex}"
        with _outage("gc"):
            self.meta.put_if_absent(marker, [b""])
            start = self.meta.last_modified(marker)
            roots = self._blocks_of(self.list_headers())
            self._header_blocks = {n: self._header_blocks[n] for n in roots}  # forget removed headers
            live = {b for refs in roots.values() if refs for b in refs}
            listed = list(self.blocks.list_info())
        cutoff = start - self.grace - CLOCK_SLACK
        unreadable = sorted(n for n, refs in roots.items() if refs is None)
        # a header we cannot read may need any block: only proof deletes, so this run deletes nothing
        doomed = [] if unreadable else [i.name for i in listed if i.name not in live and i.last_modified < cutoff]
        report = GcReport(headers=len(roots), blocks=len(listed), unreadable_headers=unreadable)
        report.young = sum(1 for i in listed if i.name not in live) - len(doomed)
        return GcPlan(marker, start, doomed, set(roots), report)

    def gc_sweep(self, plan: GcPlan) -> GcReport:
        """Sweep: delete the condemned blocks, only while the server's clock is
        inside ``sweep_window`` of the run's start (a writer that saw the marker
        waits that out, or for the ``.done`` mark written once every delete returned)."""
        report = plan.report
        for at in range(0, len(plan.doomed), 100):
            if self.server_now() + self.request_bound + CLOCK_SLACK >= plan.start + self.sweep_window:
                report.stopped_early = True  # the rest waits for the next run
                break
            batch = plan.doomed[at : at + 100]
            with _outage("gc delete"):
                self.blocks.delete_many(batch)
            report.deleted += batch
        with _outage("gc"):
            self.meta.put_if_absent(f"{plan.marker}.done", [b""])
        self._reap_markers(plan.start, plan.roots)
        return report

    def gc_runs_since(self, since: float) -> dict[str, float | None]:
        """GC runs whose sweep window was open at or after server time ``since``:
        marker -> the server time its window closes, or None if the run finished."""
        runs: dict[str, float] = {}
        done: set[str] = set()
        with _outage("gc marker listing"):
            for i in self.meta.list_info("gc/"):
                if i.name.endswith(".done"):
                    done.add(i.name.removesuffix(".done"))
                else:
                    runs[i.name] = i.last_modified + self.sweep_window + CLOCK_SLACK
        return {m: (None if m in done else end) for m, end in runs.items() if end >= since}

    def wait_for_gc_runs(self, since: float) -> bool:
        """Wait until every GC run whose window was open at or after ``since`` has
        finished or its window has closed; True if there was any such run."""
        overlapped = False
        while True:
            runs = self.gc_runs_since(since)
            overlapped = overlapped or bool(runs)
            running = [end for end in runs.values() if end is not None]
            if not running:
                return overlapped
            now = self.server_now()
            if now > max(running):
                return True
            time.sleep(min(0.25, max(running) - now))

    def _reap_markers(self, now: float, roots: Container[str]) -> None:
        """The protocol's own objects that tell nobody anything any more: GC
        markers whose window closed long ago, clock probes of handles idle for
        a grace period (a probe re-creates its object), last-use marks of
        entries gone for a grace period."""
        old = now - self.grace - CLOCK_SLACK
        try:
            with _outage("marker cleanup"):
                doomed = [i.name for i in self.meta.list_info("gc/") if i.last_modified + self.sweep_window < old]
                doomed += [i.name for i in self.meta.list_info("clock/")
                           if i.last_modified < old and i.name != f"clock/{self._node}"]
                doomed += [i.name for i in self.meta.list_info("used/")
                           if i.last_modified < old and i.name.removeprefix("used/") not in roots]
                self.meta.delete_many(doomed)
        except BucketError:
            pass

    def evict_plan(self, target_bytes: int) -> list[str]:
        """The headers ``evict_to(target_bytes)`` would remove, least recently
        used first: headers plus the blocks the rest reference then fit in
        ``target_bytes``. Only lists and reads headers (a dry run)."""
        if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 0:
            raise ValueError(f"target_bytes must be a non-negative int, got {target_bytes!r}")
        with _outage("eviction"):
            listed = self.list_headers()
            used = {i.name.removeprefix("used/"): i.last_modified for i in self.meta.list_info("used/")}
            sizes = {i.name: i.size for i in self.blocks.list_info()}
        refs = self._blocks_of(listed)
        counts: dict[str, int] = {}
        for names in refs.values():
            for b in names or ():
                counts[b] = counts.get(b, 0) + 1
        total = sum(i.size for i in listed.values()) + sum(sizes.get(b, 0) for b in counts)
        order = sorted(listed, key=lambda n: (max(listed[n].last_modified, used.get(n, 0.0)), n))
        plan = []
        for name in order:
            if total <= target_bytes:
                break
            plan.append(name)
            total -= listed[name].size
            for b in refs.get(name) or ():
                counts[b] -= 1
                if counts[b] == 0:
                    total -= sizes.get(b, 0)
        return plan

    def evict_to(self, target_bytes: int) -> list[str]:
        """Fleet-wide LRU: remove least recently used entries' headers (and their
        last-use marks) until headers plus the blocks the rest reference fit in
        ``target_bytes``. Blocks are freed by a later ``gc`` after the grace period."""
        evicted = []
        for name in self.evict_plan(target_bytes):
            with _outage("eviction"):
                self.headers.delete(name)
                self.meta.delete(f"used/{name}")
            evicted.append(name)
        return evicted


class StoreSession:
    """One store's uploads, in the write order: ``put_block`` for every block of
    the entry (new or reused, from any thread), then ``commit`` (the header).

    Freshness rule (the writer's half of GC): every block the header will name
    exists with Last-Modified no more than ``grace/2`` before ``start`` (an
    older one is re-uploaded: refreshed), so no GC run that misses the header
    can find it older than ``grace``. docs/scale-out.md has the proof."""

    def __init__(self, bucket: Bucket, start: float) -> None:
        self.bucket = bucket
        self.start = start
        self.created: set[str] = set()  # blocks this session uploaded (for stats)
        self.refreshed: set[str] = set()
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def _fresh_after(self) -> float:
        return self.start - self.bucket.grace / 2 + CLOCK_SLACK

    def put_block(self, name: str, parts: Sequence[Buffer] | Callable[[], Sequence[Buffer]]) -> bool:
        """Make block ``name`` present and fresh in the bucket; True if this call uploaded it.

        ``parts`` is the frame (a new block: one conditional PUT, a 412 is the
        dedup) or a function returning it (a block the store expects the bucket
        to hold already: a HEAD first, the body is read and sent only if needed)."""
        BLOCK_LAYOUT.check(name)
        with self._lock:
            self._names.add(name)
        pool = self.bucket.blocks
        with _outage(f"upload of block {name}"):
            if not callable(parts):
                if pool.put_if_absent(name, parts):
                    self._note(self.created, name)
                    return True
            try:
                modified = pool.last_modified(name)
            except (BlockMissingError, FileNotFoundError):
                if pool.put_if_absent(name, parts() if callable(parts) else parts):
                    self._note(self.created, name)
                    return True
                modified = pool.last_modified(name)
            if modified < self._fresh_after():  # a GC may condemn it: refresh
                pool.put_overwrite(name, parts() if callable(parts) else parts)
                self._note(self.refreshed, name)
                return True
        return False

    def _note(self, where: set[str], name: str) -> None:
        with self._lock:
            where.add(name)

    def commit(self, header_name: str, header: bytes, load_block: Callable[[str], Sequence[Buffer]]) -> None:
        """Write the header once every block it names is safe; return only once it is in the bucket.

        Waits out any GC run whose sweep window overlaps this store and then
        checks every block again (``load_block(name)`` supplies a frame to
        upload again, from the local pool); re-checks freshness once if the
        store ran past its deadline, then refuses (StoreTooSlow)."""
        HEADER_LAYOUT.check(header_name)
        decode_header(header)  # never commit garbage
        bucket = self.bucket
        for attempt in range(2):
            if bucket.wait_for_gc_runs(self.start):  # a sweep may have deleted a block after we checked it
                self._recheck(load_block)
            now = bucket.server_now()
            if now - self.start + CLOCK_SLACK <= bucket.grace / 2 - bucket.request_bound - CLOCK_SLACK:
                break
            if attempt == 1:
                raise StoreTooSlow(f"store took {now - self.start:.0f} s of server time; grace is {bucket.grace} s")
            self.start = now  # measure freshness afresh and check every block against it
            self._recheck(load_block)
        with _outage(f"header {header_name}"):
            if not bucket.headers.put_if_absent(header_name, [header]):
                raise BucketError(f"header {header_name} already exists (uuid collision?)")

    def _recheck(self, load_block: Callable[[str], Sequence[Buffer]]) -> None:
        names = sorted(self._names)
        list(self.bucket._fetchers.map(lambda n: self.put_block(n, lambda: load_block(n)), names))
