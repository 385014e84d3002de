"""Where ``blockkv route`` sends a request: the fleet as the router knows it
(fleet.py), the prompt's tokens (route_tokens.py) and the cost model
(scoring.py), without any HTTP of its own (route.py is the front). Placement
never changes an answer, only which node computes it.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator

from blockkv.router.fleet import Follower, Node
from blockkv.router.route_tokens import CHAT_PATHS, TEXT_PATHS, PromptTokenizer
from blockkv.router.scoring import Active, Matches, Option, Restores, Sessions, Start, order, queue_cost, start_cost
from blockkv.wire.auth import bearer
from blockkv.wire.residency import BLOCK_SIZE, digest_key, namespace_key, prefix_digests

log = logging.getLogger(__name__)

# ~1.5 µs per prompt byte (a 1 MiB body is ~150k tokens), and a 128k-token prompt is ~0.5 MiB of text.
MAX_TOKENIZED_BYTES = 1 << 20
MAX_PROMPT_TOKENS = 1 << 18  # and so is a prompt of more tokens: its digests are at most 8,192


class Router:
    """The fleet and the choice of a node for a prompt."""

    def __init__(self, urls: list[str], tokenizer: PromptTokenizer | None, salt: str | None,
                 node_timeout: float, node_key: str | None = None, per_key: bool = False) -> None:
        """``per_key``: the nodes keep per-key caches (``serve --per-key-cache``,
        this router's node key one of their operator keys): each request is
        placed by its client key's residency and sent naming that key's namespace."""
        if not urls:
            raise ValueError("at least one --node is needed")
        if len(set(urls)) != len(urls):
            raise ValueError("a --node is given twice")
        self.restores = Restores()  # measured from every node's restores (scoring.Restores says why per router)
        self.active = Active()  # and so is what a request in flight costs (scoring.Active)
        self.nodes = [Node(url, headers=bearer(node_key), restores=self.restores, active=self.active) for url in urls]
        self.tokenizer = tokenizer
        self.node_timeout = node_timeout
        self._key = digest_key(salt)
        self._followers = [Follower(node, self._key) for node in self.nodes]
        self._ids = itertools.count()
        self._choosing = threading.Lock()
        self.sessions = Sessions()
        self.per_key = per_key

    def start(self) -> None:
        for follower in self._followers:
            follower.start()

    def stop(self) -> None:
        for follower in self._followers:
            follower.stop()

    def next_id(self) -> int:
        return next(self._ids)

    def prompt(self, path: str, body: bytes) -> list[int] | None:
        """The request's prompt tokens, or None (routed by load alone)."""
        if self.tokenizer is None or path not in (*CHAT_PATHS, *TEXT_PATHS) or len(body) > MAX_TOKENIZED_BYTES:
            return None
        try:
            tokens = self.tokenizer.tokens(path, json.loads(body))
        except Exception as e:  # noqa: BLE001 - the node will answer whatever this was; only the choice suffers
            log.debug("blockkv route: request not tokenized (%r); routed by load", e)
            return None
        return tokens if len(tokens) <= MAX_PROMPT_TOKENS else None

    def rank(self, tokens: list[int] | None, record: bool = False,
             ns: str = "") -> list[tuple[Node, Start, list[str]]]:
        """Usable nodes, best first (scoring.order), each with its start and the
        prompt's digests in its block size; ``record``: the prompt is being routed
        (its conversation's turn is counted). ``ns``: the client key's namespace
        (per-key caches): what each node holds of it, or of the shared namespace."""
        now = time.monotonic()
        usable = [n for n in self.nodes if n.usable(now)] or list(self.nodes)  # none usable: try them all anyway
        length = len(tokens) if tokens is not None else 0
        digests_by_size: dict[tuple[int, str], list[str]] = {}

        def digests(size: int, of: str = ns) -> list[str]:
            if tokens is None or not size:
                return []
            if (size, of) not in digests_by_size:
                digests_by_size[size, of] = prefix_digests(tokens, namespace_key(self._key, of), size)
            return digests_by_size[size, of]

        def capped(blocks: int, size: int) -> int:
            return min(blocks * size, max(length - 1, 0))  # a node always computes the last prompt token

        def matched(node: Node) -> tuple[int, int]:
            own = node.matched_blocks(digests(node.block_size), now)
            if not ns:
                return own
            shared = node.matched_blocks(digests(node.block_size, ""), now)
            return max(own[0], shared[0]), max(own[1], shared[1])

        held = {n.url: matched(n) for n in self.nodes}
        bucket = {size: max((held[n.url][1] for n in self.nodes if n.remote and n.block_size == size), default=0)
                  for size in {n.block_size for n in self.nodes}}
        starts, costs = {}, self.restores.costs()
        for node in usable:
            if node.block_size:
                ram, disk = held[node.url]
                size = node.block_size
                starts[node.url] = start_cost(length, Matches(capped(ram, size), capped(disk, size),
                                                              capped(bucket[size], size)), costs)
        # a node whose residency is unknown (just restarted, not publishing yet, another salt) may hold
        # anything: it is taken to start as well as the best known node, so its queue decides its share
        best = min(starts.values(), key=lambda s: s.cost, default=start_cost(length, Matches(), costs))
        conversation = digests(BLOCK_SIZE)
        turn = self.sessions.record(conversation, now) if record else self.sessions.turn(conversation)
        meets = self.sessions.meets(turn)
        queues = {n.url: n.queue() for n in self.nodes}
        company = self.sessions.company(now, sum(q[1] for q in queues.values()))
        options = []
        for node in usable:
            start = starts.get(node.url) or Start(best.cost, "unknown", 0)
            work, in_flight = queues[node.url]
            expected = None if company is None else company.get(node.url, 0.0)
            options.append(Option(start, queue_cost(work, in_flight, node.active_cost(), meets, expected), in_flight,
                                  node.routed))
        return [(usable[i], options[i].start, digests(usable[i].block_size)) for i in order(options)]

    def candidates(self, tokens: list[int] | None, request_id: int, ns: str = "") -> Iterator[tuple[Node, Start]]:
        """The nodes to try, best first, each already charged with the request when
        yielded: ranking and charging the first are one step, so requests arriving
        together see each other's queue."""
        with self._choosing:
            ranked = self.rank(tokens, record=True, ns=ns)
            if ranked:
                ranked[0][0].begin(request_id, ranked[0][1].cost, ranked[0][2], ranked[0][1])
                self.sessions.place(ranked[0][0].url, time.monotonic())
        for i, (node, start, digests) in enumerate(ranked):
            if i:  # the first did not answer: its conversation is counted there until it turns live elsewhere
                node.begin(request_id, start.cost, digests, start)
            yield node, start
