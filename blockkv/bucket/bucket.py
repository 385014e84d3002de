"""One fingerprint directory in an S3-compatible bucket, shared by a fleet of nodes.

The mechanism of issue #14 that a store calls (docs/scale-out.md): the
directory's IDENTITY, a store's session (session.py: the write order, blocks
then the header as the commit point), header listings by which a node learns
what others wrote, verified and bounded fetches, last-use marks, and the
fleet-wide LRU eviction (evict.py) and mark-and-sweep GC (gc.py) that need no
coordinator. Every object is read with a limit known before the read, and a
copy is convicted only by proof about that copy (bucket_verdicts.py, fetch.py,
heal.py). Every time compared is the server's (``Last-Modified``), checked
against the local monotonic clock for steps (clock.py). Requests and their
failures: objects.py; the directory itself (pools, settings, clock, bounded
reads), which each of those modules takes: bucket_dir.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

from blockkv.bucket import evict
from blockkv.bucket.bucket_dir import BucketDir, FetchedHeaders, HeaderCopy
from blockkv.bucket.fetch import Local, fetch_block, submit_fetches
from blockkv.bucket.fleet_key import FleetKey
from blockkv.bucket.gc import Collector, GcPlan, GcReport
from blockkv.bucket.objects import MAX_IDENTITY_BYTES, BucketError, outage
from blockkv.bucket.session import StoreSession
from blockkv.errors import BlockMissingError, OversizedError
from blockkv.format.header import Identity
from blockkv.format.layout import HEADER_LAYOUT

__all__ = ["Bucket", "FetchedHeaders", "HeaderCopy"]


class Bucket(BucketDir):
    """A fingerprint directory in a bucket (``BucketDir``: its pools, settings,
    clock and bounded reads) with the protocol's operations on it: IDENTITY,
    a store's session, fetches that heal what they prove bad, last-use marks,
    GC and the fleet-wide LRU."""

    def __init__(self, url: str, fingerprint_dir: str, options: Mapping[str, str] | None = None, *,
                 grace: float = 3600.0, sweep_window: float = 60.0, timeout: float = 10.0,
                 connect_timeout: float = 3.0, max_retries: int = 1, fetch_threads: int = 8,
                 touch_interval: float = 60.0, key: FleetKey | None = None) -> None:
        super().__init__(url, fingerprint_dir, options, grace=grace, sweep_window=sweep_window, timeout=timeout,
                         connect_timeout=connect_timeout, max_retries=max_retries, fetch_threads=fetch_threads,
                         touch_interval=touch_interval, key=key)
        self.collector = Collector(self)
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

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

    # -- blocks -------------------------------------------------------------
    def fetch_block(self, name: str, raw_bytes: int, key: bytes | None, *, vouched: bool = False,
                    other_keys: Callable[[], Iterable[bytes | None]] = tuple,
                    local: Local | None = None) -> bytes | memoryview:
        """A block's verified frame (fetch.py): a copy proven bad is healed
        first, then CorruptBlockError; one that convicts only its header is
        CorruptHeaderError."""
        return fetch_block(self, name, raw_bytes, key, vouched=vouched, other_keys=other_keys, local=local)

    def submit_fetches(self, sizes: Mapping[str, int], key: bytes | None,
                       **proof: object) -> dict[str, Future[bytes | memoryview]]:
        """Start fetching the blocks ``sizes`` names (block -> raw bytes its
        header declares) concurrently: a future of each verified frame."""
        return submit_fetches(self, sizes, key, **proof)

    def fetch_blocks(self, sizes: Mapping[str, int], key: bytes | None, **proof: object) -> dict[str, bytes | memoryview]:
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
        return evict.evict_plan(self, self.collector, target_bytes)

    def evict_to(self, target_bytes: int) -> list[str]:
        return evict.evict_to(self, self.collector, target_bytes)
