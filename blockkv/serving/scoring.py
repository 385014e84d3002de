"""Where a request should start fastest: the router's cost model, in prompt
tokens' worth of prefill time (docs/scale-out.md, "How the router chooses").

A node's cost for a prompt of ``L`` tokens is the work to reach its first new
token, plus the work already queued on it:

- the prefix hot in its RAM tier costs nothing; the rest is prefilled (1 per token);
- a longer prefix on its local disk costs ``DISK_COST`` per token restored;
- a longer prefix in the bucket (any node can restore what a node on it
  stored) costs ``BUCKET_COST`` per token;
- each request in flight on the node adds its own unfinished start cost (its
  prefill, until its first token streams back) plus the node's active cost:
  measured from the times to first token it streams (``Pace``), ``ACTIVE_COST``
  until it has been.

The cheapest option per node is taken; the cheapest node wins, ties going to
the node with fewer requests in flight, then fewer routed so far. This is
Dynamo's KV router (prefill blocks a worker would compute, plus its active
blocks) with llm-d's tiers weighted by what reading them costs instead of a
weighted sum of normalised scores: every term is in the same unit, so a hot
node is left exactly when the queue on it costs more than the prefill it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def start_cost(length: int, m: Matches) -> Start:
    """The cost of starting a prompt of ``length`` tokens on a node with matches ``m``."""
    best = Start(float(length - m.ram), "ram" if m.ram else "cold", m.ram)
    for tier, reused, per_token in (("disk", m.disk, DISK_COST), ("bucket", m.bucket, BUCKET_COST)):
        if reused > best.reused:
            cost = per_token * reused + (length - reused)
            if cost < best.cost:
                best = Start(cost, tier, reused)
    return best


def queue_cost(unstarted_work: float, in_flight: int, active_cost: float = ACTIVE_COST) -> float:
    """What the requests in flight on a node add: their unfinished start cost plus ``active_cost`` each."""
    return unstarted_work + active_cost * in_flight


class Pace:
    """What a request in flight on one node costs a new one there, measured from
    the answers it streams instead of assumed (``ACTIVE_COST``): its time to
    first token when it found the node idle gives the seconds per unit of start
    cost, and how much later the first token came when others were in flight
    gives the delay each of them adds. Their ratio is the node's active cost in
    start-cost units: on a node that shares its cores, or batches slowly, it is
    high and a prompt hot there spills to another node sooner. Not thread-safe
    (the node's lock guards it)."""

    SMOOTHING = 0.2  # weight of the newest observation

    def __init__(self) -> None:
        self.seconds_per_unit: float | None = None
        self.delay_per_active_s: float | None = None

    def observe(self, work: float, others: int, ahead: float, ttft_s: float) -> None:
        """A request of start cost ``work``, routed while ``others`` were in flight
        with ``ahead`` of start cost not yet done, streamed its first token
        ``ttft_s`` seconds later."""
        if ttft_s < 0:
            return
        if not others:
            self.seconds_per_unit = self._mean(self.seconds_per_unit, ttft_s / max(work, 1.0))
        elif self.seconds_per_unit is not None:  # the prefills ahead are in queue_cost already: not counted twice
            extra = max(0.0, ttft_s - (work + ahead) * self.seconds_per_unit)
            self.delay_per_active_s = self._mean(self.delay_per_active_s, extra / others)

    def active_cost(self) -> float:
        """The start cost a request in flight here adds to a new one (``ACTIVE_COST`` until measured)."""
        if not self.seconds_per_unit or self.delay_per_active_s is None:
            return ACTIVE_COST
        return min(max(self.delay_per_active_s / self.seconds_per_unit, 1.0), 1e6)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)


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
