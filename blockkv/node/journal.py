"""What a ``blockkv serve`` node holds, as sequence-numbered events a router
can follow: the journal behind ``GET /blockkv/events`` and
``GET /blockkv/residency`` (blockkv/node/residency_endpoint.py serves them).

The vocabulary is vLLM's KV events (``vllm/distributed/kv_events.py``), so an
indexer written for them (llm-d's, Dynamo's) reads it: batches with a sequence
number and a time, each a list of ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ...),
``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``. Two
differences, both forced by privacy or by having two tiers: ``token_ids`` is
always empty (a digest is published, never a token: ``blockkv.wire.residency``), and
``AllBlocksCleared`` names the ``medium`` it clears (``RAM``: mlx-lm's prompt
cache; ``DISK``: the node's local blockkv store).

An entry (a cached prompt) covers every whole block of its tokens. Entries
share prefixes, so each medium counts the entries holding a digest:
``BlockStored`` names only digests no entry held before, ``BlockRemoved`` only
those no entry holds any more. A reader that misses events (its ``since`` fell
out of the bounded log, or the node restarted: another ``epoch``) is told to
resync, and reads the snapshot.

Every answer also carries ``restored``: per tier (``disk``, ``bucket``) the
prompt tokens the node restored this epoch and the seconds that took, from
the lookup to the cache handed to mlx-lm. A router prices a restore by them
(``router/scoring.py``'s ``Restores``); they name no prompt.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from blockkv.wire.residency import (
    BLOCK_SIZE,
    MAX_WAIT_S,
    MEDIA,
    RESTORE_TIERS,
    namespace_key,
    prefix_digests,
    salt_check,
)

KEEP_BATCHES = 4096  # the log a late reader can still replay; older ones resync
MAX_BATCHES_PER_READ = 256


class Journal:
    """The residency of one node, per medium, and the events that changed it.
    Thread-safe: the generation thread, the disk watcher and HTTP readers share it."""

    def __init__(self, key: bytes, block_size: int = BLOCK_SIZE, keep: int = KEEP_BATCHES) -> None:
        self.epoch = uuid.uuid4().hex  # a restarted node is another epoch: its readers resync
        self.block_size = block_size
        self.remote = False  # the disk tier shares a bucket (what is on its disk is in the bucket)
        self._key = key
        self._salt_check = salt_check(key)
        self._cond = threading.Condition()
        self._seq = 0
        self._log: deque[tuple[int, dict[str, Any]]] = deque(maxlen=keep)
        self._entries: dict[str, dict[Hashable, tuple[str, ...]]] = {m: {} for m in MEDIA}
        self._refs: dict[str, Counter[str]] = {m: Counter() for m in MEDIA}
        self._restored = {tier: [0, 0.0] for tier in RESTORE_TIERS}  # tier -> [tokens, seconds] this epoch

    def apply(self, medium: str, stored: Iterable[tuple[Hashable, Sequence[int] | np.ndarray]] = (),
              removed: Iterable[Hashable] = (), *, cleared: bool = False, ns: str = "") -> None:
        """One batch: ``medium`` cleared first (if ``cleared``), then the entries
        ``stored`` (key, tokens) added and those keyed ``removed`` dropped. Adding
        a key held, or dropping one not held, changes nothing. ``stored`` are
        entries of namespace ``ns`` (their digests keyed by ``namespace_key``)."""
        if medium not in MEDIA:
            raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
        entries, refs = self._entries[medium], self._refs[medium]
        events: list[dict[str, Any]] = []
        with self._cond:
            if cleared and entries:
                entries.clear()
                refs.clear()
                events.append({"type": "AllBlocksCleared", "medium": medium})
            for key, tokens in stored:
                if key in entries:
                    continue
                # interned: an entry keeps pointers to the digests the counts hold, not its own copies
                digests = entries[key] = tuple(map(sys.intern, prefix_digests(tokens, namespace_key(self._key, ns),
                                                                              self.block_size)))
                new = [i for i, d in enumerate(digests) if refs[d] == 0]
                refs.update(digests)
                if new:
                    events.append({"type": "BlockStored", "block_hashes": [digests[i] for i in new],
                                   "parent_block_hash": digests[new[0] - 1] if new[0] else None,
                                   "token_ids": [], "block_size": self.block_size, "lora_id": None,
                                   "medium": medium, "lora_name": None})
            for key in removed:
                gone = []
                for d in entries.pop(key, ()):
                    refs[d] -= 1
                    if refs[d] <= 0:
                        del refs[d]
                        gone.append(d)
                if gone:
                    events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": medium})
            if events:
                self._seq += 1
                self._log.append((self._seq, {"seq": self._seq, "ts": time.time(), "events": events}))
                self._cond.notify_all()

    def restored(self, tier: str, tokens: int, seconds: float) -> None:
        """The node restored ``tokens`` prompt tokens from ``tier`` in ``seconds``
        (``PersistentPromptCache.restore_observers``): summed into the
        ``restored`` every answer carries, so the router prices a restore by
        what the node spent on it rather than by a constant, from the first
        restore of any request, busy node or idle."""
        if tier in self._restored and tokens > 0 and seconds >= 0:
            with self._cond:
                self._restored[tier][0] += tokens
                self._restored[tier][1] += seconds

    def read(self, since: int, wait: float = 0.0, limit: int = MAX_BATCHES_PER_READ) -> dict[str, Any]:
        """The batches after sequence ``since`` (at most ``limit``), waiting up to
        ``wait`` seconds for one if there is none yet; ``resync: true`` when the
        log no longer reaches back to ``since`` (read the snapshot)."""
        with self._cond:
            if since == self._seq and wait > 0:
                self._cond.wait_for(lambda: self._seq != since, timeout=min(wait, MAX_WAIT_S))
            first = self._log[0][0] if self._log else self._seq + 1
            head = {"epoch": self.epoch, "block_size": self.block_size, "restored": self._restored_now()}
            if since > self._seq or since < first - 1:
                return {**head, "resync": True, "seq": self._seq}
            batches = [batch for seq, batch in self._log if seq > since][:limit]
            return {**head, "resync": False, "seq": batches[-1]["seq"] if batches else since, "batches": batches}

    def snapshot(self) -> dict[str, Any]:
        """Every digest each medium holds now, as of sequence ``seq``: where a reader starts."""
        with self._cond:
            return {"epoch": self.epoch, "seq": self._seq, "block_size": self.block_size,
                    "salt_check": self._salt_check, "remote": self.remote, "restored": self._restored_now(),
                    "media": {m: sorted(self._refs[m]) for m in MEDIA}}

    def _restored_now(self) -> dict[str, dict[str, float]]:
        return {tier: {"tokens": tokens, "seconds": seconds} for tier, (tokens, seconds) in self._restored.items()}

    def held(self, medium: str) -> set[str]:
        """The digests ``medium`` holds now."""
        with self._cond:
            return set(self._refs[medium])
