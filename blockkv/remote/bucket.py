"""One fingerprint directory in an S3-compatible bucket, shared by a fleet of nodes.

The mechanism of issue #14 that a store calls (docs/scale-out.md): the
directory's IDENTITY and MANIFEST, a store's session (session.py: the write
order, blocks then the header as the commit point), header listings by which
a node learns what others wrote, verified concurrent block fetches, last-use
marks, and the fleet-wide LRU eviction and mark-and-sweep GC that need no
coordinator (gc.py). Every time compared is the server's (``Last-Modified``),
never a local wall clock; local monotonic time only paces waits that end in
a fresh look at the server's clock. Requests and their failures: objects.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptError, NewerFormatError
from blockkv.format.frame import decode_block
from blockkv.format.header import Header, Identity
from blockkv.local.directory import HEADER_LAYOUT, verified_header
from blockkv.pool.protocol import BLOCK_LAYOUT
from blockkv.remote.gc import Collector, GcPlan, GcReport
from blockkv.remote.objects import CLOCK_SLACK, META_LAYOUT, BucketError, BucketPool, ObjectInfo, outage
from blockkv.remote.session import StoreSession


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
        self.blocks = BucketPool(f"{base}/blobs", BLOCK_LAYOUT, **config)
        self.headers = BucketPool(f"{base}/entries", HEADER_LAYOUT, **config)
        self.meta = BucketPool(base, META_LAYOUT, **config)
        self.grace = grace
        self.sweep_window = sweep_window
        self.touch_interval = touch_interval
        self._node = uuid.uuid4().hex  # this handle's clock probe object
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="blockkv-bucket")
        self._collector = Collector(self)
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    # -- time -----------------------------------------------------------------
    @property
    def clock_probe(self) -> str:
        """This handle's object whose Last-Modified ``server_now`` reads."""
        return f"clock/{self._node}"

    def server_now(self) -> float:
        """The server's clock: Last-Modified of an object this handle just wrote."""
        with outage("clock probe"):
            self.meta.put_overwrite(self.clock_probe, [b""])
            return self.meta.last_modified(self.clock_probe)

    # -- identity -------------------------------------------------------------
    def ensure_identity(self, identity: Identity) -> None:
        """Create IDENTITY, or check that the one there names the same model and tokenizer."""
        body = {"format": 1, "model_id": identity.model_id, "config_fingerprint": identity.config_fingerprint,
                "tokenizer_hash": identity.tokenizer_hash}
        with outage("IDENTITY"):
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
            with outage("manifest"):
                return self.meta.get("MANIFEST")
        except BlockMissingError:
            return None

    def put_manifest(self, data: bytes) -> None:
        with outage("manifest"):
            self.meta.put_overwrite("MANIFEST", [data])

    # -- writing --------------------------------------------------------------
    def begin_store(self) -> StoreSession:
        """Start a store: takes the server time its freshness rules are measured from."""
        return StoreSession(self, self.server_now())

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

    def fetch_header(self, name: str) -> tuple[bytes, Header]:
        """A header's bytes and what they say, verified (checksum, bounds, descriptor)."""
        with outage(f"fetch of header {name}"):
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
        with outage(f"fetch of block {name}"):
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
            with outage("quarantine"):
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
        with outage("touch"):
            self.meta.put_overwrite(f"used/{header_name}", [b""])

    # -- the fleet's GC and eviction (gc.py) ------------------------------------
    def gc(self) -> GcReport:
        """One mark-and-sweep run (safe beside any number of writers and other runs)."""
        return self.gc_sweep(self.gc_mark())

    def gc_mark(self) -> GcPlan:
        return self._collector.mark()

    def gc_sweep(self, plan: GcPlan) -> GcReport:
        return self._collector.sweep(plan)

    def evict_plan(self, target_bytes: int) -> list[str]:
        return self._collector.evict_plan(target_bytes)

    def evict_to(self, target_bytes: int) -> list[str]:
        return self._collector.evict_to(target_bytes)
