"""How a ``blockkv serve`` node publishes what it holds (journal.py's journal)
for ``blockkv route``: its RAM tier, its local disk, and whether that disk is
shared through a bucket.

- ``ResidentPromptCache``: ``PersistentPromptCache`` that, after every call that
  can change mlx-lm's RAM tier, compares the tier's entries with the last
  look (by identity: at most ``max_size`` entries, no token is hashed twice)
  and journals the difference. Only the server's default model is published;
  with per-key caches each key's entries too, their digests keyed by the key's
  namespace (``residency.namespace_key``), so they match only that key's
  prompts (a router places a key's requests by them).
- ``DiskWatcher``: follows the store's index change log (``BlockStore.changes``,
  one LMDB read when nothing changed) on a thread, so the disk tier, its
  evictions and what other processes on the same root did are journalled
  without a scan per request. It starts when the store opens, which
  ``blockkv serve`` does before it answers ``/health``: a restarted node
  publishes what its disk holds at once, and its first request does not wait
  for the open.
- ``residency_handler``: mlx-lm's ``APIHandler`` plus ``GET /blockkv/events``
  (``?since=SEQ&wait=SECONDS``, a long poll) and ``GET /blockkv/residency``
  (the snapshot).

Publishing never fails a request: a fault here is one warning, after which
that medium is published as empty (a router then sends fewer requests to this
node, never wrong ones).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from blockkv import BlockStore
from blockkv.errors import LockTimeout
from blockkv.local.locks import waiting_at_most
from blockkv.mlx_lm.prompt_cache import PersistentPromptCache
from blockkv.node.journal import Journal
from blockkv.wire.auth import is_key_namespace
from blockkv.wire.residency import MAX_WAIT_S

log = logging.getLogger(__name__)

DISK_POLL_S = 0.25


class ResidentPromptCache(PersistentPromptCache):
    """A ``PersistentPromptCache`` whose RAM tier (entries of ``model_key``) and
    disk tier are journalled in ``journal``."""

    def __init__(self, *args: Any, journal: Journal, model_key: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal
        self.model_key = model_key
        self.restore_observers.append(journal.restored)
        self._ram: dict[int, tuple[str, list[int]]] = {}  # id(tokens) -> (ns, tokens): mlx-lm's key lists, kept alive
        self._ram_broken = False
        self._watcher: DiskWatcher | None = None
        self._relist = False  # the store was opened before the first request: list the bucket then

    def open_published(self) -> None:
        """Open the published model's store, and so start publishing its disk (and
        whether it is on a bucket): ``blockkv serve`` calls it before it serves.
        The bucket is listed again at the first request, as a store opened then
        would have: what the fleet stored since the start is restored, not prefilled."""
        if self.store_for(self.model_key) is not None:
            self._relist = True

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        if self._relist and model == self.model_key:
            self._relist = False
            store = self.store_for(model)
            try:
                store.sync_remote()  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - a listing missed costs restores, never the request
                log.warning("blockkv: listing the bucket at the first request failed (%r)", e)
        found = super().fetch_nearest_cache(model, tokens)  # a disk hit is also inserted into the RAM tier
        self._ram_changed()
        return found

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        self._ram_changed()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
        self._ram_changed()

    def store_for(self, model: Any) -> BlockStore | None:
        store = super().store_for(model)
        if store is not None and model == self.model_key and self._watcher is None:
            self.journal.remote = store.remote is not None
            self._watcher = DiskWatcher(self.journal, store)
            self._watcher.start()
        return store

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        super().close()

    def _ram_changed(self) -> None:
        """Journal what entered and left the RAM tier since the last call. mlx-lm
        keeps each entry's key list in its LRU order (``CacheOrder``): a list
        seen before is the same entry, one gone is an eviction or a trim."""
        if self._ram_broken:
            return
        try:
            now = {id(tokens): (ns, tokens) for lru in self._lru._lrus.values()
                   for model, tokens in lru if (ns := self._published_namespace(model)) is not None}
        except Exception as e:  # noqa: BLE001 - another mlx-lm's internals: publish no RAM tier
            self._ram_broken = True
            log.warning("blockkv: cannot follow mlx-lm's RAM tier (%r); its residency is not published", e)
            self.journal.apply("RAM", cleared=True)
            return
        added = [(i, ns, t) for i, (ns, t) in now.items() if i not in self._ram and t and min(t) >= 0]  # no images
        removed = [i for i in self._ram if i not in now]
        self._ram = now
        if removed:
            self.journal.apply("RAM", (), removed)
        for ns in dict.fromkeys(ns for _, ns, _ in added):
            self.journal.apply("RAM", [(i, t) for i, n, t in added if n == ns], ns=ns)

    def _published_namespace(self, model: Any) -> str | None:
        """The namespace of a RAM-tier entry keyed ``model`` that is published:
        the default model's shared one (``""``) or a key's (``(model, ns)``, its
        digests keyed by the namespace); None for anything else."""
        if model == self.model_key:
            return ""
        if isinstance(model, tuple) and len(model) == 2 and model[0] == self.model_key and is_key_namespace(model[1]):
            return str(model[1])
        return None


class DiskWatcher:
    """Journals a store's local entries (the default namespace, the store's own
    identity) by following its index's change log every ``interval`` seconds."""

    def __init__(self, journal: Journal, store: BlockStore, interval: float = DISK_POLL_S) -> None:
        self._journal = journal
        self._store = store
        self._owner = store.identity.digest()
        self._interval = interval
        self._position: tuple[bytes, int] | None = None
        self._stopped = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="blockkv-disk-residency", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.poll()
            self._stopped.wait(self._interval)

    def poll(self) -> None:
        """One read of the change log, never waiting for the index: while
        another process holds it (stopped inside a transaction), the next
        poll reads from the same position."""
        try:
            with waiting_at_most(0.0):
                changes = self._store.changes(self._position)
        except LockTimeout:
            return
        except Exception as e:  # noqa: BLE001 - a closed or failing store: start over when it answers
            if not self._warned:
                log.warning("blockkv: cannot follow the disk tier's changes (%r); retrying", e)
                self._warned = True
            self._position = None
            return
        self._warned = False
        ours = [r for r in changes.added if r.owner == self._owner and (r.ns == "" or is_key_namespace(r.ns))]
        if changes.removed or changes.reset:
            self._journal.apply("DISK", (), changes.removed, cleared=changes.reset)
        for ns in dict.fromkeys(r.ns for r in ours):  # a key's entries: digests keyed by its namespace
            self._journal.apply("DISK", [(r.id, r.tokens) for r in ours if r.ns == ns], ns=ns)
        self._position = changes.position


def residency_handler(base: type, journal: Journal, allowed: Callable[[Any], bool] | None = None) -> type:
    """mlx-lm's request handler class ``base`` with the two residency endpoints,
    answered only to requests ``allowed(handler)`` accepts (403 otherwise), if given."""

    class ResidencyHandler(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            if path in ("/blockkv/residency", "/blockkv/events") and allowed is not None and not allowed(self):
                self._send_json(403, {"error": "the residency is the operator's to read (--operator-key-file)"})
            elif path == "/blockkv/residency":
                self._send_json(200, journal.snapshot())
            elif path == "/blockkv/events":
                try:
                    args = {k: v[-1] for k, v in parse_qs(query, strict_parsing=bool(query)).items()}
                    since, wait = int(args.get("since", "0")), float(args.get("wait", "0"))
                    if since < 0 or not 0 <= wait <= MAX_WAIT_S:
                        raise ValueError("since must be >= 0 and wait in [0, 30]")
                except ValueError as e:
                    self._send_json(400, {"error": str(e)})
                    return
                self._send_json(200, journal.read(since, wait))
            else:
                super().do_GET()

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            if code == 200 and self.path.startswith("/blockkv/events"):
                return  # a router long-polls it all day: one access-log line per poll drowned the rest
            super().log_request(code, size)

        def _send_json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body, separators=(",", ":")).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            try:
                self.end_headers()
                self.wfile.write(data)
            except ConnectionError:  # the reader left (a router that stopped during a long poll)
                self.close_connection = True

    return ResidencyHandler
