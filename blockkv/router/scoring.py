"""Where a request should start fastest: the router's cost model, in prompt
tokens' worth of prefill time (docs/scale-out.md, "How the router chooses").

A node's cost for a prompt of ``L`` tokens is the work to reach its first new
token, plus the work already queued on it:

- the prefix hot in its RAM tier costs nothing; the rest is prefilled (1 per token);
- a longer prefix on its local disk costs ``disk`` per token restored, and
  one in the bucket (any node can restore what a node on it stored)
  ``bucket`` per token, when the node would restore it (``start_cost``);
  both measured from the restore times the nodes report (``Restores``),
  ``DISK_COST`` and ``BUCKET_COST`` until they have been;
- each request in flight on the node adds its own unfinished start cost (its
  prefill, until its first token streams back or the node's pace has worked
  it off) plus the active cost: measured from the times to first token the
  nodes stream (``Pace``, ``Active``: one per router), ``ACTIVE_COST`` until
  it has been;
- a request in flight is a session that stays on the node (its prefix is
  there), and so is the new one: they meet on this turn and on the turns the
  new one's conversation still sends, so the active cost is charged that
  many times (``Sessions``: measured from the prompts routed), each time
  with the requests the node's live conversations are expected to have in
  flight then (``Sessions.company``: conversations not always in flight meet
  less often). A node whose sessions keep it busy is left by a new session
  once that costs more than restoring the shared prefix elsewhere; a later
  turn, with fewer turns left and more to restore, stays.

The cheapest node wins, ties going to
the node with fewer requests in flight, then fewer routed so far. This is
Dynamo's KV router (prefill blocks a worker would compute, plus its active
blocks) with llm-d's tiers weighted by what reading them costs instead of a
weighted sum of normalised scores: every term is in the same unit, so a hot
node is left exactly when the queue on it costs more than the prefill it saves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from blockkv.wire.residency import RESTORE_READ_PER_SAVED, RESTORE_TIERS

# Restoring a token costs this fraction of prefilling it: the project measured a
# local restore 56x faster than prefill (docs/mlx-lm.md uses 1/16, with margin,
# for the same decision) and a bucket restore 0.09x a local one (issue #23).
DISK_COST = 1 / 16
BUCKET_COST = 1 / 4
# A request in flight delays a new one on the same node by about what
# prefilling this many tokens takes: mlx-lm's server lets a new request join
# its batch only between time budgets of up to 0.5 s, so a busy node answers
# later whatever the prompt. Measured with tools/route_bench.py (a tiny model
# on 2 CPU cores): a later turn that found its node busy with one request
# started 0.33 s later than one that found it idle, about 66 tokens of prefill
# at the 195 tokens/s measured for the same model in one process.
ACTIVE_COST = 64.0


@dataclass(frozen=True)
class Matches:
    """Prompt tokens one node could start from, per tier (already capped at ``L - 1``)."""

    ram: int = 0
    disk: int = 0
    bucket: int = 0


@dataclass(frozen=True)
class Start:
    """The cheapest way a node starts a prompt: its cost and the tier it reads."""

    cost: float
    tier: str  # "ram", "disk", "bucket", "cold", or "unknown" (the node's residency is)
    reused: int  # prompt tokens not prefilled
    prefilled: int = 0  # prompt tokens prefilled


@dataclass(frozen=True)
class RestoreCosts:
    """What restoring a token from each tier costs, in tokens' worth of prefill."""

    disk: float = DISK_COST
    bucket: float = BUCKET_COST


def start_cost(length: int, m: Matches, costs: RestoreCosts = RestoreCosts()) -> Start:
    """The cost of starting a prompt of ``length`` tokens on a node with matches
    ``m``, the way the node starts it: its cache restores the longest prefix on
    its disk or in the bucket when that saves a token of prefill per
    ``RESTORE_READ_PER_SAVED`` it reads (``PersistentPromptCache``), else it
    prefills what its RAM tier lacks. The router predicts that choice; it does
    not make it: priced as its own choice of the cheapest tier, a node whose
    RAM held a shorter prefix was counted as prefilling what its cache then
    restored from the bucket, and the restore was timed as prefill."""
    tier, reused = ("bucket", m.bucket) if m.bucket > m.disk else ("disk", m.disk)
    if reused > m.ram and (reused - m.ram) * RESTORE_READ_PER_SAVED >= reused:
        per_token = costs.bucket if tier == "bucket" else costs.disk
        return Start(per_token * reused + (length - reused), tier, reused, length - reused)
    return Start(float(length - m.ram), "ram" if m.ram else "cold", m.ram, length - m.ram)


def queue_cost(unstarted_work: float, in_flight: int, active_cost: float = ACTIVE_COST, meets: float = 1.0,
               company: float | None = None) -> float:
    """What the requests in flight on a node add: their unfinished start cost,
    plus ``active_cost`` for each of them on this turn, and on each of the
    ``meets - 1`` later turns of the new request's conversation for each
    request expected in flight there then: ``company`` (``Sessions.company``),
    else the requests in flight now (every conversation always in flight)."""
    later = in_flight if company is None else company
    return unstarted_work + active_cost * (in_flight + (meets - 1.0) * later)


@dataclass(frozen=True)
class Home:
    """Where a conversation's last turn went, when, and which turn it was."""

    node: str
    at: float  # time.monotonic()
    turn: int


class Sessions:
    """How many turns a conversation sends, measured from the prompts routed
    instead of assumed: a prompt whose chain of block digests holds the last
    digest of an earlier prompt is that conversation's next turn, any other a
    new conversation. The mean is prompts over new conversations, both counts
    forgetting old prompts. With every conversation on the node that holds it,
    two sessions placed together meet on every turn they both still send: on
    tools/route_bench.py's soak (12 sessions of 8 turns, 3 clients, 2 system
    prompts) an active cost charged once left every session of one system
    prompt on one node (48/32/16 requests a node).

    Conversations are not always in flight: a pool of 3 clients over 12
    conversations (``route_bench.py --interleave 4 --pooled``) has each in
    flight a quarter of the time. So the sessions also keep where each live
    conversation's last turn went (``place``): the live ones (their last turn
    routed within twice the measured gap between turns, fewer turns sent than
    the mean) are what will send turns to their nodes, each in flight the
    share of the time the fleet's requests in flight are of them
    (``company``). Not thread-safe (the router's choosing lock guards it)."""

    MEMORY = 0.02  # weight of the newest prompt in the counts: about the last 50 prompts
    LIMIT = 4096  # conversations remembered (their last prompts' digests)

    def __init__(self) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()  # a prompt's last digest -> its turn
        self._prompts = 0.0
        self._new = 0.0
        self._homes: OrderedDict[str, Home] = OrderedDict()  # a conversation's last digest -> its last turn's node
        self._gap: float | None = None  # seconds between a conversation's turns being routed (moving mean)
        self._placing: tuple[str, int] | None = None  # the prompt recorded last: its last digest, its turn

    def turn(self, digests: Sequence[str]) -> int:
        """A prompt's turn in its conversation (1: a new one), from its digests."""
        return next((self._last[d] + 1 for d in reversed(digests) if d in self._last), 1)

    def record(self, digests: Sequence[str], now: float = 0.0) -> int:
        """A prompt with these digests was routed at ``now`` (a ``time.monotonic()``);
        returns its ``turn``. Its conversation is no longer at home anywhere until ``place``."""
        turn = self.turn(digests)
        self._prompts += self.MEMORY * (1.0 - self._prompts)
        self._new += self.MEMORY * (float(turn == 1) - self._new)
        earlier = next((d for d in reversed(digests) if d in self._homes), None)
        if earlier is not None:
            gap = now - self._homes.pop(earlier).at
            self._gap = gap if self._gap is None else self._gap + 0.2 * (gap - self._gap)
        self._placing = None
        if digests:
            self._last[digests[-1]] = turn
            self._last.move_to_end(digests[-1])
            while len(self._last) > self.LIMIT:
                self._last.popitem(last=False)
            self._placing = (digests[-1], turn)
        return turn

    def place(self, node: str, now: float) -> None:
        """The prompt recorded last went to ``node``: its conversation lives there."""
        if self._placing is not None:
            digest, turn = self._placing
            self._homes[digest] = Home(node, now, turn)
            self._homes.move_to_end(digest)
            while len(self._homes) > self.LIMIT:
                self._homes.popitem(last=False)

    def company(self, now: float, in_flight: int) -> dict[str, float] | None:
        """Per node, the requests its live conversations are expected to have in
        flight at a time (``in_flight`` of the fleet's, shared by all live ones);
        None until the gap between turns is measured."""
        if self._gap is None:
            return None
        mean = self._prompts / self._new if self._new > 0 else 1.0
        live = [h.node for h in self._recent(now - 2 * self._gap) if h.turn < mean]
        duty = min(1.0, in_flight / len(live)) if live else 0.0
        homed: dict[str, float] = {}
        for node in live:
            homed[node] = homed.get(node, 0.0) + duty
        return homed

    def _recent(self, since: float) -> Iterator[Home]:
        """The homes placed at ``since`` or later, newest first: ``place`` appends
        in time order, so the walk stops at the first older one instead of
        visiting all ``LIMIT`` (4,095 homes: 453 µs a request under the
        router's choosing lock, now the live ones only)."""
        for home in reversed(self._homes.values()):
            if home.at < since:
                return
            yield home

    def meets(self, turn: int) -> float:
        """The turns a prompt at ``turn`` meets a session placed beside it: this
        one and those a conversation of the mean length sends after it (1 until
        measured)."""
        mean = self._prompts / self._new if self._new > 0 else 1.0
        return max(1.0, mean - turn + 1)


class Pace:
    """How fast one node works through start cost, measured from the answers
    it streams: a request's time to first token when it found the node idle
    gives the node's seconds per unit of start cost (a node that shares its
    cores, or is slower, takes more). Busy, the delay beyond its own start
    feeds the router's ``Active``, in this node's units. A request that
    restored from the disk or the bucket measures nothing here (its start cost
    holds a restore cost the node reports after the fact: ``Restores``). Not
    thread-safe (the node's lock guards it)."""

    SMOOTHING = 0.2  # weight of the newest observation

    def __init__(self) -> None:
        self.seconds_per_unit: float | None = None

    def observe(self, work: float, others: int, ttft_s: float, active: Active) -> None:
        """A request of start cost ``work``, routed while ``others`` were in flight
        (their prefills done), streamed its first token ``ttft_s`` seconds later,
        nothing sent beside it meanwhile (``Node.started`` says why only then)."""
        if ttft_s < 0:
            return
        if not others:
            self.seconds_per_unit = _smoothed(self.seconds_per_unit, ttft_s / max(work, 1.0), self.SMOOTHING)
        elif self.seconds_per_unit is not None:
            extra = max(0.0, ttft_s - work * self.seconds_per_unit)
            active.observe(extra / others / self.seconds_per_unit)


class Active:
    """What a request in flight on a node adds to a new one's start, in
    start-cost units, measured instead of assumed (``ACTIVE_COST``): the
    delay a busy first token came out after its own start would have, per
    request beside it, over its node's seconds per unit (``Pace``).

    One per router, not per node: what a request in flight costs is the
    server's batching (mlx-lm takes a new request between time budgets of up
    to 0.5 s and prefills it beside the others), the same on every node of a
    fleet of one model, and a node that is slower at everything says so in
    its own seconds per unit. Measured per node, from the handful of first
    tokens each sees that hold nothing else, it came out anywhere from 1 to
    100 between the nodes of one fleet, the router took the node measured
    lowest for the cheapest to queue on and sent it most requests (issue
    #44's pooled shape: 74/84/136 requests a node with active costs 65, 64
    and 4.4; 128/82/91 with 5.3, 8.7 and the prior). A moving mean of the
    observations, kept within [1, 10^6]. Thread-safe (every node's answers
    feed it)."""

    SMOOTHING = 0.2  # weight of the newest observation, as Pace's

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units: float | None = None

    def observe(self, units: float) -> None:
        """A request in flight delayed a new one by ``units`` of its node's start cost."""
        with self._lock:
            self._units = _smoothed(self._units, units, self.SMOOTHING)

    def cost(self) -> float:
        """The start cost a request in flight adds to a new one (``ACTIVE_COST`` until measured)."""
        with self._lock:
            return ACTIVE_COST if self._units is None else min(max(self._units, 1.0), 1e6)


class Restores:
    """What restoring a token from the disk or the bucket costs against
    prefilling it, measured instead of assumed (``DISK_COST``,
    ``BUCKET_COST``): each node publishes the tokens it restored from a tier
    and the seconds that took, from the lookup to the cache handed to mlx-lm
    (``restored`` in its residency answers, node/journal.py), and a restore
    of ``R`` tokens in ``s`` seconds on a node whose prefill takes
    ``seconds_per_unit`` a token (its ``Pace``) cost ``s / seconds_per_unit``
    start-cost units, ``cost * R``. The constants are one model's KV over one
    network (issue #23's); on a model with little KV a token over loopback a
    bucket restore costs ~1/1,400 of prefill, not 1/4, and a router that
    prices it at 1/4 keeps a conversation waiting behind another on its node
    rather than restore it on an idle one (issue #44's pooled shape: 35.7 % of
    later turns sent to a busy node, round-robin 6.5 %).

    Reported by the node, not solved from a first token's time: a router
    solving it from the times to first token of restores on idle nodes
    measured it only when a fresh fleet happened to restore on an idle node
    (on the pooled shape, half of the router fleets never did and kept 1/4,
    their later turns 1.41 s against 1.17-1.28 s for those that measured).
    Every restore counts now, on a busy node too (its seconds then hold the
    node's other work: dearer, never cheaper, than the restore alone).

    One per router, not per node: what a restore costs against a prefill is
    the model's KV bytes a token against its compute a token, and the path to
    the one bucket, both the fleet's; a node that is slower at everything
    (shared cores) is slower at both, which its own ``seconds_per_unit``
    already says. Means of the start cost and of the tokens restored, each
    smoothed, then their ratio, kept within ``[FLOOR, CEILING]``.
    Thread-safe (every node's answers feed it)."""

    SMOOTHING = 0.2  # weight of the newest observation, as Pace's
    FLOOR = 1e-4  # never free: a tier's restore still reads its bytes
    CEILING = 1.0  # never worse than prefilling: a node whose restore fails prefills instead
    PRIOR = RestoreCosts()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units: dict[str, float] = {}  # tier -> smoothed start-cost units of a report's restores
        self._reused: dict[str, float] = {}  # tier -> smoothed tokens they restored

    def observe(self, tier: str, tokens: int, seconds: float, seconds_per_unit: float | None) -> None:
        """A node whose prefill takes ``seconds_per_unit`` a token restored
        ``tokens`` from ``tier`` in ``seconds`` (one restore or several)."""
        if tier not in RESTORE_TIERS or tokens <= 0 or not seconds_per_unit or seconds < 0:
            return
        with self._lock:
            self._units[tier] = _smoothed(self._units.get(tier), seconds / seconds_per_unit, self.SMOOTHING)
            self._reused[tier] = _smoothed(self._reused.get(tier), float(tokens), self.SMOOTHING)

    def costs(self) -> RestoreCosts:
        """The per-token costs now: measured where measured, else the prior."""
        with self._lock:
            return RestoreCosts(self._cost("disk", self.PRIOR.disk), self._cost("bucket", self.PRIOR.bucket))

    def _cost(self, tier: str, prior: float) -> float:
        if tier not in self._units:
            return prior
        return min(max(self._units[tier] / self._reused[tier], self.FLOOR), self.CEILING)


def _smoothed(old: float | None, new: float, weight: float) -> float:
    """A moving mean: ``new`` weighs ``weight``, the first is taken whole."""
    return new if old is None else old + weight * (new - old)


@dataclass(frozen=True)
class Option:
    """One node's prospects for a prompt."""

    start: Start
    queue: float  # queue_cost of the node
    in_flight: int
    routed: int  # requests routed to it so far

    @property
    def cost(self) -> float:
        return self.start.cost + self.queue


def order(options: list[Option]) -> list[int]:
    """Indices of ``options``, best first: cheapest, then fewer in flight, then fewer routed."""
    return sorted(range(len(options)), key=lambda i: (options[i].cost, options[i].in_flight, options[i].routed))
