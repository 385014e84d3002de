"""One fingerprint directory in an S3-compatible bucket, as every worker of the
bucket protocol sees it: its three pools (blocks, headers, the directory's
own objects), its settings, the server's clock, its headers listed and read
(bounded, verified), and its blocks read and judged (bounded; bucket_verdicts.py).

It decides nothing about a copy it judges bad: ``read_block`` raises
``ProvenBad`` and the caller (fetch.py) heals. GC (gc.py), healing (heal.py),
verified fetches (fetch.py), a store's session (session.py) and eviction
(evict.py) each take a ``BucketDir``; ``Bucket`` (bucket.py) is one, plus the
operations those modules provide. So every module here imports only from
below it.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

from blockkv.bucket.bucket_verdicts import convicts, frame_limit
from blockkv.bucket.clock import CLOCK_SLACK, Reading, read_clock
from blockkv.bucket.fleet_key import FleetKey
from blockkv.bucket.objects import BucketError, BucketPool, ObjectInfo, outage
from blockkv.errors import (
    BlockMissingError,
    CorruptBlockError,
    CorruptError,
    CorruptHeaderError,
    NewerFormatError,
    OversizedError,
)
from blockkv.format.descriptor import ParsedDescriptor
from blockkv.format.frame import Judgement, judge_block
from blockkv.format.header import MAX_HEADER_BYTES, Header
from blockkv.format.layout import BLOCK_LAYOUT, HEADER_LAYOUT, META_LAYOUT, entry_id_of, header_name, parsed_header

_LARGE_HEADER = 1 << 20  # headers above this are fetched one at a time: bounds what planted ones cost


@dataclass(frozen=True)
class HeaderCopy:
    """A header's bytes as the bucket holds them under ``name``, verified."""

    data: bytes
    header: Header
    etag: str  # of the object these bytes are ("" if unknown)
    sealed: bool  # carries a valid fleet seal for its name (False without a key)
    descriptor: ParsedDescriptor  # the header's, as verifying it parsed it


@dataclass
class FetchedHeaders:
    found: dict[str, HeaderCopy] = field(default_factory=dict)
    damaged: dict[str, bool] = field(default_factory=dict)  # name -> carries a valid seal anyway


class ProvenBad(CorruptBlockError):
    """A bucket copy of a block proven bad (bucket_verdicts.py): the copy with ``etag``
    is what is wrong, and only it may be replaced or deleted (fetch.py)."""

    def __init__(self, name: str, etag: str, why: str) -> None:
        super().__init__(f"block {name} in the bucket {why}")
        self.etag = etag


class BucketDir:
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
        self._large = threading.Lock()  # one large header fetched at a time

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    def map(self, fn: Callable, items: Iterable) -> Iterable:
        """``fn`` over ``items`` on the fetch threads (results in order)."""
        return self._fetchers.map(fn, items)

    def submit(self, fn: Callable, *args: object, **kwargs: object):
        """``fn(*args, **kwargs)`` on a fetch thread."""
        return self._fetchers.submit(fn, *args, **kwargs)

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

    # -- headers --------------------------------------------------------------
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
        header, parsed = parsed_header(name, data)
        if header_name(header.ns, entry_id_of(name)) != name:
            raise CorruptHeaderError(f"{name}: the header is of another namespace's directory")
        return HeaderCopy(data, header, etag, self.key is not None and self.key.header_sealed(name, data), parsed)

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

    # -- blocks ---------------------------------------------------------------
    def read_block(self, name: str, raw_bytes: int, key: bytes | None, *, vouched: bool = False,
                   other_keys: Callable[[], Iterable[bytes | None]] = tuple) -> memoryview:
        """A block's frame, read with the most a frame of ``raw_bytes`` can be as
        the limit and verified against its name under ``key`` (the namespace key
        of the header that names it; ``other_keys()``: keys other entries this
        node knows name it with, tried if that fails). A copy that is another
        key's block, or of another size than the header says, convicts the
        header: CorruptHeaderError, the block stays. A copy proven bad
        (bucket_verdicts.py; ``vouched``: the header is sealed, so its key is known for
        sure) is ``ProvenBad``; without proof, CorruptHeaderError."""
        try:
            with outage(f"fetch of block {name}"):
                data, meta = self.blocks.read_limited(name, frame_limit(raw_bytes))
        except OversizedError as exc:  # larger than any frame the header allows
            if not vouched:
                raise CorruptHeaderError(f"block {name} is larger than its header says: {exc}") from None
            raise ProvenBad(name, exc.etag, f"is larger than its sealed header allows ({exc})") from None
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
        raise ProvenBad(name, (meta.get("e_tag") or "").strip('"'), reason)

