"""The router's view of its nodes: what each holds (learned from its residency
events, node/residency_endpoint.py), what the router sent it and has not finished, and whether
it answers.

Everything here can be lost: a restarted router snapshots every node again.
A node's digests come from a less trusted process, so every read is bounded
(size and time) and every value checked; one that is not as published is a
node with unknown residency (it still serves requests), never an exception.
A node that does not answer is skipped, and tried again after a backoff that
doubles up to ``MAX_BACKOFF_S``.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard
from urllib.parse import urlsplit

from blockkv.router.scoring import Active, Pace, Restores, Start
from blockkv.wire.residency import MEDIA, RESTORE_TIERS, is_digest, salt_check

log = logging.getLogger(__name__)

MAX_DIGESTS = 1 << 18  # per node and medium: 8M tokens of distinct prefixes, about 40 MB of the router's memory
MAX_SNAPSHOT_BYTES = 16 << 20  # two media of MAX_DIGESTS, 19 bytes each in JSON, with room
MAX_EVENTS_BYTES = 16 << 20
LONG_POLL_S = 10.0
POLL_TIMEOUT_S = 5.0  # beyond the long poll: a busy node still answers a poll within this
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
NO_RESIDENCY_RETRY_S = 30.0  # a node that publishes nothing (plain mlx_lm server, other salt): asked again
MAX_SEQ = 2**63 - 1  # a node's event sequence number (a count of batches) never reaches this
PREDICTED_TTL_S = 10.0  # a routed prompt counts as hot there this long after it finished, until events confirm it


class BadResidency(ValueError):
    """A node's residency answer is not as published: its residency is unknown."""


class KeyRefused(LookupError):
    """A node answered 401: it does not take the router's key."""


class Held:
    """The digests a node holds in one medium, the most recently stored
    ``cap``: past it the oldest are forgotten (a node that publishes more, or
    a flood of events, costs the router a bounded memory and at worst a
    prompt it routes as if that node had to prefill it)."""

    def __init__(self, digests: Iterable[str] = (), cap: int = MAX_DIGESTS) -> None:
        self._cap = cap
        self._digests: dict[str, None] = {}  # insertion order: the oldest first
        self.update(digests)

    def __contains__(self, digest: object) -> bool:
        return digest in self._digests

    def __iter__(self) -> Iterator[str]:
        return iter(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def update(self, digests: Iterable[str]) -> None:
        for d in digests:
            self._digests.pop(d, None)
            self._digests[d] = None
        for d in list(itertools.islice(self._digests, max(0, len(self._digests) - self._cap))):
            del self._digests[d]

    def difference_update(self, digests: Iterable[str]) -> None:
        for d in digests:
            self._digests.pop(d, None)

    def clear(self) -> None:
        self._digests.clear()


@dataclass
class InFlight:
    """A request the router sent a node and has not finished relaying."""

    work: float  # its start cost when it was routed
    digests: list[str]
    others: int  # requests in flight on the node when it was routed
    ahead: float  # their start cost not yet done then
    sent_at: float  # time.monotonic() then
    start: Start | None  # how it was to start, if known: a restore's first token measures no pace
    started: bool = False  # its first token came back: its prefill is done
    joined: bool = False  # another request was sent to the node before its first token came back


@dataclass
class Node:
    """One ``blockkv serve`` node, named by ``url`` exactly as ``--node`` gave it."""

    url: str
    host: str = field(init=False)
    port: int = field(init=False)
    prefix: str = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    up: bool = True  # until a request or a poll says otherwise
    failures: int = 0
    retry_at: float = 0.0
    epoch: str | None = None
    seq: int = 0
    block_size: int = 0  # 0: residency unknown
    remote: bool = False
    held: dict[str, Held] = field(default_factory=lambda: {m: Held() for m in MEDIA})
    predicted: dict[str, float] = field(default_factory=dict)  # digest -> until (inf while in flight)
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    routed: int = 0
    pace: Pace = field(default_factory=Pace)
    restores: Restores = field(default_factory=Restores)  # the router's, shared by its nodes
    active: Active = field(default_factory=Active)  # the router's too
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # sent with every request (its API key)
    key_refused: bool = False  # its last answer to the router was 401: the router's key is wrong for it
    # its restores' (tokens, seconds) per tier as of the last answer measured into ``restores``
    restores_taken: dict[str, tuple[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"--node must be an http://HOST:PORT URL, got {self.url!r}")
        self.host, self.port, self.prefix = parts.hostname, parts.port or 80, parts.path.rstrip("/")

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    # -- health ------------------------------------------------------------------
    def usable(self, now: float) -> bool:
        return not self.key_refused and (self.up or now >= self.retry_at)

    def answered(self) -> None:
        with self.lock:
            self.up, self.failures = True, 0

    def refuses_key(self, refused: bool) -> bool:
        """Note whether the node just refused the router's key (a 401: no client's key
        reaches a node, so the router's own is at fault); returns ``refused``."""
        with self.lock:
            if refused and not self.key_refused:
                log.warning("blockkv route: node %s refuses the key this router sends (--node-api-key-file, "
                            "else $BLOCKKV_NODE_API_KEY); no request is sent it while it does, unless no node takes it",
                            self.url)
            self.key_refused = refused
        return refused

    def failed(self, why: object) -> None:
        """Skip this node for a backoff that doubles with each failure in a row."""
        with self.lock:
            if self.up:
                log.warning("blockkv route: node %s is not answering (%s); skipped, retried with backoff", self.url, why)
            self.up = False
            self.retry_at = time.monotonic() + min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** self.failures)
            self.failures += 1

    # -- residency -----------------------------------------------------------------
    def forget(self) -> None:
        """Residency unknown: the next poll reads a snapshot."""
        with self.lock:
            self.epoch, self.seq, self.block_size = None, 0, 0
            for digests in self.held.values():
                digests.clear()
            self.predicted.clear()

    def load_snapshot(self, snap: Any, key: bytes) -> bool:
        """Take a ``/blockkv/residency`` answer; False if it is salted with another key."""
        if not isinstance(snap, dict) or not isinstance(snap.get("media"), dict):
            raise BadResidency("snapshot is not an object with media")
        epoch, seq, block_size = _head(snap)
        if snap.get("salt_check") != salt_check(key):
            self.forget()
            return False
        held = {m: Held(_digests(snap["media"].get(m, []))) for m in MEDIA}
        restored = _restored(snap)
        with self.lock:
            if epoch != self.epoch:
                self.predicted.clear()  # a restarted node holds nothing the router sent its last life
                self.restores_taken.clear()  # and counts its restores from zero
            self.epoch, self.seq, self.block_size = epoch, seq, block_size
            self.remote = snap.get("remote") is True
            self.held = held
            self._measure_restores(restored)
        return True

    def apply_events(self, answer: Any) -> bool:
        """Take a ``/blockkv/events`` answer; False if the node says to resync."""
        if not isinstance(answer, dict):
            raise BadResidency("events answer is not an object")
        epoch, seq, block_size = _head(answer)
        if epoch != self.epoch or block_size != self.block_size or answer.get("resync") is not False:
            return False
        batches = answer.get("batches")
        if not isinstance(batches, list) or not all(isinstance(b, dict) and isinstance(b.get("events"), list)
                                                    for b in batches):
            raise BadResidency("batches is not a list of objects with a list of events")
        changes = [_event(e) for b in batches for e in b["events"]]
        restored = _restored(answer)
        with self.lock:
            self._measure_restores(restored)
            for kind, medium, digests in changes:
                if kind == "AllBlocksCleared":
                    self.held[medium].clear()
                elif kind == "BlockStored":
                    self.held[medium].update(digests)
                    for d in digests:
                        self.predicted.pop(d, None)  # confirmed
                else:
                    self.held[medium].difference_update(digests)
            self.seq = seq
        return True

    def _measure_restores(self, restored: dict[str, tuple[int, float]]) -> None:
        """What the node spent restoring since the last answer, per tier, into the
        router's ``Restores``, priced against this node's prefill pace; kept for
        a later answer while the pace is not measured yet."""
        seconds_per_unit = self.pace.seconds_per_unit
        for tier, (tokens, seconds) in restored.items():
            taken_tokens, taken_seconds = self.restores_taken.get(tier, (0, 0.0))
            if tokens < taken_tokens or seconds < taken_seconds:  # counted anew (not this epoch's counts)
                self.restores_taken[tier] = (tokens, seconds)
            elif tokens > taken_tokens and seconds_per_unit:
                self.restores.observe(tier, tokens - taken_tokens, seconds - taken_seconds, seconds_per_unit)
                self.restores_taken[tier] = (tokens, seconds)

    def matched_blocks(self, digests: list[str], now: float) -> tuple[int, int]:
        """How many leading blocks of a prompt are in RAM (or routed here lately), and on disk."""
        with self.lock:
            ram, disk, predicted = self.held["RAM"], self.held["DISK"], self.predicted
            hot = next((i for i, d in enumerate(digests) if d not in ram and predicted.get(d, 0.0) <= now),
                       len(digests))
            cold = next((i for i, d in enumerate(digests) if d not in disk), len(digests))
        return hot, cold

    # -- what the router sent it ---------------------------------------------------------
    def begin(self, request_id: int, work: float, digests: list[str], start: Start | None = None) -> None:
        """The request was sent here, with start cost ``work`` (``start``'s, if given)."""
        with self.lock:
            now = time.monotonic()
            ahead = sum(self._unstarted(r, now) for r in self.in_flight.values())
            for request in self.in_flight.values():
                request.joined = request.joined or not request.started
            self.in_flight[request_id] = InFlight(work, digests, len(self.in_flight), ahead, now, start)
            self.routed += 1
            for d in digests:
                self.predicted.pop(d, None)
                self.predicted[d] = float("inf")
            for d in list(itertools.islice(self.predicted, max(0, len(self.predicted) - MAX_DIGESTS))):
                del self.predicted[d]  # the oldest: at worst a prompt routed as if it had to be prefilled

    def started(self, request_id: int, now: float | None = None) -> None:
        """Its first token streamed back (at ``now``, a ``time.monotonic()``): the
        node's pace is measured by it if its time holds only its own start and
        the requests in flight beside it, which it does not when:

        - it restored: its start was priced at a restore cost the node reports
          after the fact (timed as prefill, a restore priced at the prior 1/4
          of prefill and taking 1/100 came out early and pulled the node's
          active cost towards its floor);
        - another request was sent to the node before its first token: mlx-lm
          prefills them together, so a request timed alone held the
          newcomer's prefill and overstated the node's seconds per unit;
        - it was sent behind prefills not yet done: those are charged as
          queued work already, and prefilled together with its own they came
          out early, so the delay left for the requests in flight was 0 and
          pulled their active cost down (6.4 on one of two pinned nodes where
          a later turn found busy took 0.5 s longer than one found idle; 117
          and 70 after)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            request = self.in_flight.get(request_id)
            if request is None or request.started:
                return
            request.started = True
            start = request.start
            restored = start is not None and start.tier in RESTORE_TIERS and start.reused > 0
            if not restored and not request.joined and not request.ahead:
                self.pace.observe(request.work, request.others, now - request.sent_at, self.active)

    def abandon(self, request_id: int) -> None:
        """The request never reached the node: no trace of it here."""
        with self.lock:
            done = self.in_flight.pop(request_id, None)
            for d in done.digests if done is not None else ():
                if self.predicted.get(d) == float("inf") and not any(d in r.digests for r in self.in_flight.values()):
                    del self.predicted[d]

    def end(self, request_id: int) -> None:
        now = time.monotonic()
        with self.lock:
            done = self.in_flight.pop(request_id, None)
            for d in done.digests if done is not None else ():
                self.predicted[d] = now + PREDICTED_TTL_S
            self.predicted = {d: t for d, t in self.predicted.items() if t > now}

    def queue(self) -> tuple[float, int]:
        """(unstarted work, requests) in flight here."""
        now = time.monotonic()
        with self.lock:
            return sum(self._unstarted(r, now) for r in self.in_flight.values()), len(self.in_flight)

    def _unstarted(self, request: InFlight, now: float) -> float:
        """A request's start cost not yet done: none once its first token
        streamed back, else what the node's pace has not worked off since it
        was sent (all of it until the pace is measured). A non-streamed answer
        streams no first token: counted whole until it ended, its prefill was
        charged to every request beside it long after it was done."""
        if request.started:
            return 0.0
        seconds_per_unit = self.pace.seconds_per_unit
        if not seconds_per_unit:
            return request.work
        return max(0.0, request.work - (now - request.sent_at) / seconds_per_unit)

    def active_cost(self) -> float:
        return self.active.cost()


def _head(answer: dict[str, Any]) -> tuple[str, int, int]:
    epoch, seq, block_size = answer.get("epoch"), answer.get("seq"), answer.get("block_size")
    if not isinstance(epoch, str) or not 0 < len(epoch) <= 64:
        raise BadResidency("epoch is not a short string")
    if not _int(seq) or not 0 <= seq <= MAX_SEQ or not _int(block_size) or not 1 <= block_size <= 4096:
        raise BadResidency("seq or block_size out of range")
    return epoch, seq, block_size


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _digests(values: object) -> list[str]:
    if not isinstance(values, list) or not all(is_digest(v) for v in values):
        raise BadResidency("digests are not a list of 16 hex characters each")
    return values  # type: ignore[return-value]


def _restored(answer: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """An answer's ``restored`` (what the node spent restoring, per tier, this
    epoch): {} from a node that does not publish it."""
    restored = answer.get("restored")
    if restored is None:
        return {}
    if not isinstance(restored, dict) or not set(restored) <= set(RESTORE_TIERS):
        raise BadResidency("restored is not an object of restore tiers")
    out = {}
    for tier, counts in restored.items():
        tokens = counts.get("tokens") if isinstance(counts, dict) else None
        seconds = counts.get("seconds") if isinstance(counts, dict) else None
        if not (_int(tokens) and 0 <= tokens <= MAX_SEQ and isinstance(seconds, (int, float))
                and not isinstance(seconds, bool) and 0 <= seconds < math.inf):
            raise BadResidency(f"restored {tier!r} is not a count of tokens and of seconds")
        out[tier] = (tokens, float(seconds))
    return out


def _event(event: object) -> tuple[str, str, list[str]]:
    if not isinstance(event, dict) or event.get("medium") not in MEDIA:
        raise BadResidency("an event without a known medium")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return kind, event["medium"], []
    if kind in ("BlockStored", "BlockRemoved"):
        return kind, event["medium"], _digests(event.get("block_hashes"))
    raise BadResidency(f"unknown event type {kind!r}")


def read_json(node: Node, path: str, limit: int, timeout: float) -> Any:
    """GET ``path`` on ``node``: the JSON body of a 200, at most ``limit`` bytes.
    ``LookupError`` for another status (the node runs, but not this endpoint)."""
    conn = node.connection(timeout)
    try:
        conn.request("GET", node.prefix + path, headers=node.headers)
        response = conn.getresponse()
        body = response.read(limit + 1)
        if response.status == 401:
            raise KeyRefused(f"{path}: HTTP 401")
        if response.status != 200:
            raise LookupError(f"{path}: HTTP {response.status}")
        if len(body) > limit:
            raise BadResidency(f"{path}: answer over {limit} bytes")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an integer of over 4,300 digits
            raise BadResidency(f"{path}: not JSON ({e})") from e
    finally:
        conn.close()


class Follower:
    """Follows one node's residency on a thread: a snapshot, then long-polled
    events; a missed event, a restart or a bad answer means a new snapshot."""

    def __init__(self, node: Node, key: bytes) -> None:
        self.node = node
        self._key = key
        self._stopped = threading.Event()
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"blockkv-follow {node.url}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        log.log(logging.WARNING if kind not in self._warned else logging.DEBUG, message, *args)
        self._warned.add(kind)

    def _run(self) -> None:
        node = self.node
        while not self._stopped.is_set():
            wait = max(0.0, node.retry_at - time.monotonic()) if not node.up else 0.0
            if wait and self._stopped.wait(wait):
                return
            try:
                if node.epoch is None:
                    snap = read_json(node, "/blockkv/residency", MAX_SNAPSHOT_BYTES, POLL_TIMEOUT_S)
                    if not node.load_snapshot(snap, self._key):
                        self._warn_once("salt", "blockkv route: node %s publishes digests with another "
                                        "--fleet-salt; its residency is ignored", node.url)
                        node.answered()
                        self._stopped.wait(NO_RESIDENCY_RETRY_S)
                        continue
                else:
                    path = f"/blockkv/events?since={node.seq}&wait={LONG_POLL_S:g}"
                    if not node.apply_events(read_json(node, path, MAX_EVENTS_BYTES, LONG_POLL_S + POLL_TIMEOUT_S)):
                        node.forget()
                node.answered()
                node.refuses_key(False)
            except KeyRefused:  # warned by refuses_key; asked again later, with a new key the node may take it
                node.refuses_key(True)
                node.forget()
                node.answered()
                self._stopped.wait(NO_RESIDENCY_RETRY_S)
            except (BadResidency, LookupError) as e:  # it answers, but its residency is unknown
                self._warn_once("bad", "blockkv route: residency of node %s unusable (%s); routing without it",
                                node.url, e)
                node.forget()
                node.answered()
                self._stopped.wait(NO_RESIDENCY_RETRY_S)
            except (OSError, http.client.HTTPException) as e:
                node.failed(e)
            except Exception as e:  # noqa: BLE001 - a bug of ours on a node's answer must not end the following
                self._warn_once("error", "blockkv route: following node %s failed (%r); routing without its "
                                "residency, asked again later", node.url, e)
                node.forget()
                self._stopped.wait(NO_RESIDENCY_RETRY_S)
