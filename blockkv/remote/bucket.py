"""One fingerprint directory in an S3-compatible bucket, shared by a fleet of nodes.

The mechanism of issue #14 that a store calls (docs/scale-out.md): the
directory's IDENTITY, a store's session (session.py: the write order, blocks
then the header as the commit point), header listings by which a node learns
what others wrote, verified and bounded fetches, last-use marks, and the
fleet-wide LRU eviction (evict.py) and mark-and-sweep GC (gc.py) that need no
coordinator. Every object is read with a limit known before the read, and a
copy is convicted only by proof about that copy (verify.py, heal.py). Every
time compared is the server's (``Last-Modified``), checked against the local
monotonic clock for steps (clock.py). Requests and their failures: objects.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

from blockkv.errors import (
    BlockMissingError,
    CorruptBlockError,
    CorruptError,
    CorruptHeaderError,
    NewerFormatError,
    OversizedError,
)
from blockkv.format.header import MAX_HEADER_BYTES, SUFFIX, Header, Identity
from blockkv.local.directory import HEADER_LAYOUT, verified_header
from blockkv.pool.protocol import BLOCK_LAYOUT
from blockkv.remote import evict, heal
from blockkv.remote.clock import CLOCK_SLACK, Reading, read_clock
from blockkv.remote.fleet_key import FleetKey
from blockkv.remote.gc import Collector, GcPlan, GcReport
from blockkv.remote.objects import (
    MAX_IDENTITY_BYTES,
    META_LAYOUT,
    BucketError,
    BucketPool,
    ObjectInfo,
    header_name,
    outage,
)
from blockkv.remote.session import StoreSession
from blockkv.format.frame import Judgement, judge_block
from blockkv.remote.verify import convicts, frame_limit

_LARGE_HEADER = 1 << 20  # headers above this are fetched one at a time: bounds what planted ones cost


@dataclass(frozen=True)
class HeaderCopy:
    """A header's bytes as the bucket holds them under ``name``, verified."""

    data: bytes
    header: Header
    etag: str  # of the object these bytes are ("" if unknown)
    sealed: bool  # carries a valid fleet seal for its name (False without a key)


@dataclass
class FetchedHeaders:
    found: dict[str, HeaderCopy] = field(default_factory=dict)
    damaged: dict[str, bool] = field(default_factory=dict)  # name -> carries a valid seal anyway


class Bucket:
    """``<url>/<fingerprint dir>/``: blocks, headers, IDENTITY and the protocol's marks.

    ``grace`` (seconds of server time) must exceed twice the longest store: a
    store whose first block check to header takes more than ``grace/2 -
    request_bound - 2 s`` is re-checked once and then refused. ``sweep_window``
    bounds how long after it starts a GC run may still delete; a writer whose
    store overlaps a run waits for it (at most that long) and checks its blocks
    again. ``key``: the fleet key (fleet_key.py), or None. docs/scale-out.md
    ("GC across nodes") has the protocol and its proof."""

    def __init__(self, url: str, fingerprint_dir: str, options: Mapping[str, str] | None = None, *,
                 grace: float = 3600.0, sweep_window: float = 60.0, timeout: float = 10.0,
                 connect_timeout: float = 3.0, max_retries: int = 1, fetch_threads: int = 8,
                 touch_interval: float = 60.0, key: FleetKey | None = None) -> None:
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
        self.directory = fingerprint_dir
        self.blocks = BucketPool(f"{base}/blobs", BLOCK_LAYOUT, **config)
        self.headers = BucketPool(f"{base}/entries", HEADER_LAYOUT, **config)
        self.meta = BucketPool(base, META_LAYOUT, **config)
        self.grace = grace
        self.sweep_window = sweep_window
        self.touch_interval = touch_interval
        self.key = key
        self._node = uuid.uuid4().hex  # this handle's clock probe object
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="blockkv-bucket")
        self.collector = Collector(self)
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()
        self._large = threading.Lock()  # one large header fetched at a time

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    def map(self, fn: Callable, items: Iterable) -> Iterable:
        """``fn`` over ``items`` on the fetch threads (results in order)."""
        return self._fetchers.map(fn, items)

    # -- time -----------------------------------------------------------------
    @property
    def clock_probe(self) -> str:
        """This handle's object whose Last-Modified ``server_now`` reads."""
        return f"clock/{self._node}"

    def clock_reading(self) -> Reading:
        """The server's clock (Last-Modified of an object this handle just
        wrote), with the local monotonic times around the request."""
        def probe() -> float:
            self.meta.put_overwrite(self.clock_probe, [b""])
            return self.meta.last_modified(self.clock_probe)

        with outage("clock probe"):
            return read_clock(probe)

    def server_now(self) -> float:
        return self.clock_reading().server

    def marker_body(self, name: str) -> bytes:
        """The body of a protocol mark this handle writes: its seal, or empty."""
        return self.key.marker_body(name) if self.key is not None else b""

    # -- identity -------------------------------------------------------------
    def ensure_identity(self, identity: Identity) -> str | None:
        """Create IDENTITY, or check that the one there names the same model and
        tokenizer: another model's is a ValueError, and so is one that is not
        an IDENTITY at all (one clear line). With a fleet key, one not sealed
        with it is not acted on: it is sealed if it names this model, else
        ignored; the returned line says so (None when there is nothing to say)."""
        body = {"format": 1, "model_id": identity.model_id, "config_fingerprint": identity.config_fingerprint,
                "tokenizer_hash": identity.tokenizer_hash}
        sealed = self.key.seal_identity(self.directory, body) if self.key is not None else body
        with outage("IDENTITY"):
            data, meta = b"", {"e_tag": ""}
            for _ in range(3):  # created, or read; one removed between the two is made again
                if self.meta.put_if_absent("IDENTITY", [json.dumps(sealed, indent=1).encode()]):
                    return None
                try:
                    data, meta = self.meta.get_limited("IDENTITY", MAX_IDENTITY_BYTES)
                    break
                except BlockMissingError:
                    continue
                except OversizedError:  # read no further
                    data = b"more than 64 KiB"
                    break
            else:
                raise BucketError(f"{self.url}/IDENTITY neither created nor read")
            try:
                found = json.loads(data)
                same = all(found[k] == body[k] for k in ("model_id", "config_fingerprint", "tokenizer_hash"))
            except (ValueError, KeyError, TypeError) as exc:
                detail = data.decode() if data == b"more than 64 KiB" else str(exc).partition(":")[0][:80]
                found, same, why = None, False, f"is not a blockkv IDENTITY ({detail})"
            else:
                why = "names another model or tokenizer"
            if self.key is not None and not (isinstance(found, dict) and self.key.identity_sealed(self.directory, found)):
                if same and self.meta.put_if_match("IDENTITY", [json.dumps(sealed, indent=1).encode()],
                                                   meta.get("e_tag") or ""):
                    return f"{self.url}/IDENTITY was not sealed with the fleet key: sealed it"
                return f"{self.url}/IDENTITY is not sealed with the fleet key ({why}): ignored"
        if not same:
            raise ValueError(f"{self.url}/IDENTITY {why}: remove it if this fleet serves this model")
        return None

    # -- reading --------------------------------------------------------------
    def list_headers(self, ns_dir: str = "") -> dict[str, ObjectInfo]:
        """Every header (of one namespace directory when given): the fleet's committed entries."""
        with outage("header listing"):
            return {i.name: i for i in self.headers.list_info(f"{ns_dir}/" if ns_dir else "")}

    def new_headers(self, known: Iterable[str]) -> list[str]:
        """Headers not in ``known`` (a previous listing or the local index), oldest first."""
        known = set(known)
        listed = self.list_headers()
        return sorted((n for n in listed if n not in known), key=lambda n: (listed[n].last_modified, n))

    def header_copy(self, name: str, data: bytes, etag: str) -> HeaderCopy:
        """``data`` as the header ``name``, verified: checksum, bounds, descriptor,
        and that it is the object its name claims (its namespace's directory).
        CorruptError, or NewerFormatError, otherwise."""
        header = verified_header(name, data)
        if header_name(header.ns, name.rpartition("/")[2].removesuffix(SUFFIX)) != name:
            raise CorruptHeaderError(f"{name}: the header is of another namespace's directory")
        return HeaderCopy(data, header, etag, self.key is not None and self.key.header_sealed(name, data))

    def fetch_header(self, name: str, size: int | None = None) -> HeaderCopy:
        """A header (``size``: its size as listed, if known), read with the
        format's cap as the limit (OversizedError above it) and verified."""
        if size is not None and size > MAX_HEADER_BYTES:
            raise OversizedError(f"{name}: {size} bytes is more than a header can be; not read")
        big = size is None or size > _LARGE_HEADER
        with self._large if big else nullcontext(), outage(f"fetch of header {name}"):
            data, meta = self.headers.get_limited(name, MAX_HEADER_BYTES)
        return self.header_copy(name, data, (meta.get("e_tag") or "").strip('"'))

    def fetch_headers(self, names: Iterable[str], sizes: Mapping[str, int] | None = None) -> FetchedHeaders:
        """Many headers at once, concurrently (a node's open): verified copies,
        and the damaged ones (whether each carries a valid seal anyway). A
        header gone since it was listed is left out; an outage raises
        BucketError. Nothing here deletes a damaged one: a later format's
        header looks the same to this version."""
        sizes = sizes or {}

        def read(name: str) -> tuple[str, HeaderCopy | bool | None]:
            try:
                return name, self.fetch_header(name, sizes.get(name))
            except BlockMissingError:
                return name, None  # evicted since it was listed: left out
            except (CorruptError, NewerFormatError, OversizedError):
                return name, self._sealed_anyway(name, sizes.get(name))

        out = FetchedHeaders()
        for name, result in self._fetchers.map(read, list(dict.fromkeys(names))):
            if isinstance(result, HeaderCopy):
                out.found[name] = result
            elif result is not None:
                out.damaged[name] = result
        return out

    def _sealed_anyway(self, name: str, size: int | None) -> bool:
        """A header that does not read (a later format, a damaged digest): does it
        carry a valid seal? Then a key holder wrote it, and GC keeps its blocks."""
        if self.key is None or (size is not None and size > MAX_HEADER_BYTES):
            return False
        try:
            with self._large, outage(f"fetch of header {name}"):
                data, _ = self.headers.get_limited(name, MAX_HEADER_BYTES)
            return len(data) > 52 and self.key.header_sealed(name, data)
        except (BlockMissingError, OversizedError, ValueError, BucketError):
            return False

    def fetch_block(self, name: str, raw_bytes: int, key: bytes | None, *, vouched: bool = False,
                    other_keys: Callable[[], Iterable[bytes | None]] = tuple,
                    local: Callable[[str], bytes | None] | None = None) -> bytes:
        """A block's frame, read with the most a frame of ``raw_bytes`` can be as
        the limit and verified against its name under ``key`` (the namespace key
        of the header that names it; ``other_keys()``: keys other entries this
        node knows name it with, tried if that fails). A copy that is another
        key's block, or of another size than the header says, convicts the
        header: CorruptHeaderError, the block stays. A copy proven bad
        (verify.py; ``vouched``: the header is sealed, so its key is known for
        sure) is replaced by a verified ``local(name)`` copy if the node holds
        one, else deleted inside a window with a request for a good copy
        (heal.py): CorruptBlockError. Without proof: CorruptHeaderError."""
        try:
            with outage(f"fetch of block {name}"):
                data, meta = self.blocks.get_limited(name, frame_limit(raw_bytes))
        except OversizedError as exc:  # larger than any frame the header allows
            if not vouched:
                raise CorruptHeaderError(f"block {name} is larger than its header says: {exc}") from None
            with outage(f"fetch of block {name}"):
                etag = self.blocks.info(name).etag
            return self._convicted(name, etag, local, f"is larger than its sealed header allows ({exc})")
        verdict = judge_block(name, data, [key])
        if not verdict.good:
            verdict = judge_block(name, data, [key, *other_keys(), None])
        if verdict.good and verdict.key == key and verdict.raw_bytes == raw_bytes:
            return data
        if verdict.good:
            raise CorruptHeaderError(f"block {name} is good, but not of the size or namespace its header says")
        if not convicts(verdict, vouched):
            raise CorruptHeaderError(f"block {name} does not hash to its name under the key its header "
                                     "implies (a rotten block or a lying header: not proof, kept)")
        reason = "does not decode" if verdict.judgement is Judgement.BROKEN else "does not hash to its name"
        return self._convicted(name, (meta.get("e_tag") or "").strip('"'), local, reason)

    def _convicted(self, name: str, etag: str, local: Callable[[str], bytes | None] | None, why: str) -> bytes:
        good = local(name) if local is not None else None
        try:
            if good is not None:
                heal.replace_bad_copy(self, name, etag, good)
                return good
            heal.quarantine(self, {name: etag})
        except BucketError:
            pass  # the next reader finds it bad again
        raise CorruptBlockError(f"block {name} in the bucket {why}")

    def submit_fetches(self, sizes: Mapping[str, int], key: bytes | None, **proof: object) -> dict[str, Future[bytes]]:
        """Start fetching the blocks ``sizes`` names (block -> raw bytes its
        header declares) concurrently: a future of each verified frame."""
        return {n: self._fetchers.submit(self.fetch_block, n, raw, key, **proof) for n, raw in sizes.items()}

    def fetch_blocks(self, sizes: Mapping[str, int], key: bytes | None, **proof: object) -> dict[str, bytes]:
        """Verified frames, fetched concurrently. Raises BlockMissingError /
        CorruptError for the first bad one (a miss), BucketError on an outage."""
        futures = self.submit_fetches(sizes, key, **proof)
        try:
            return {n: f.result() for n, f in futures.items()}
        finally:
            for f in futures.values():
                f.cancel()

    # -- writing --------------------------------------------------------------
    def begin_store(self, key: bytes | None = None) -> StoreSession:
        """Start a store of an entry whose blocks are named with ``key``: takes
        the server time its freshness rules are measured from."""
        return StoreSession(self, self.clock_reading(), key)

    def touch(self, header: str) -> None:
        """Record a use of an entry where every node sees it (``used/<header>``'s
        Last-Modified), at most once per ``touch_interval`` per entry and handle."""
        HEADER_LAYOUT.check(header)
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(header, -self.touch_interval) < self.touch_interval:
                return
            self._touched[header] = now
        with outage("touch"):
            self.meta.put_overwrite(f"used/{header}", [b""])

    # -- the fleet's GC and eviction (gc.py, evict.py) ------------------------------
    def gc(self) -> GcReport:
        """One mark-and-sweep run (safe beside any number of writers and other runs)."""
        return self.gc_sweep(self.gc_mark())

    def gc_mark(self) -> GcPlan:
        return self.collector.mark()

    def gc_sweep(self, plan: GcPlan) -> GcReport:
        return self.collector.sweep(plan)

    def evict_plan(self, target_bytes: int) -> list[str]:
        return evict.evict_plan(self, target_bytes)

    def evict_to(self, target_bytes: int) -> list[str]:
        return evict.evict_to(self, target_bytes)
