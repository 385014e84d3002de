"""Where a request should start fastest: the router's cost model, in prompt
tokens' worth of prefill time (docs/scale-out.md, "How the router chooses").

A node's cost for a prompt of ``L`` tokens is the work to reach its first new
token, plus the work already queued on it:

- the prefix hot in its RAM tier costs nothing; the rest is prefilled (1 per token);
- a longer prefix on its local disk costs ``DISK_COST`` per token restored;
- a longer prefix in the bucket (any node can restore what a node on it
  stored) costs ``BUCKET_COST`` per token;
- each request in flight on the node adds its own unfinished start cost (its
  prefill, until its first token streams back) plus ``ACTIVE_COST``.

The cheapest option per node is taken; the cheapest node wins, ties going to
the node with fewer requests in flight, then fewer routed so far; except that
the node reusing the most of the prompt keeps it unless another is cheaper by
more than ``MOVE_MARGIN``. This is
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
# A request in flight past its prefill still takes a share of every batch step
# (mlx-lm decodes requests together): charged as this many prompt tokens. A
# decode step costs what prefilling about one token does on a CPU (measured
# with the demo model) and a few tens on a GPU, where decoding is bound by
# memory; a new prompt shares a few of those steps with each such request.
ACTIVE_COST = 16.0
# Below this many tokens of estimated gain, a conversation stays on the node
# that holds most of it: the queue terms are estimates (a request's prefill is
# taken to end when its first token streams back), and a conversation that
# moves leaves its history behind, so its next turn finds less on either node.
MOVE_MARGIN = 128.0


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
    tier: str  # "ram", "disk", "bucket" or "cold"
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


def queue_cost(unstarted_work: float, in_flight: int) -> float:
    """What the requests in flight on a node add: their unfinished start cost plus ``ACTIVE_COST`` each."""
    return unstarted_work + ACTIVE_COST * in_flight


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
    """Indices of ``options``, best first (see the module's docstring)."""
    best = sorted(range(len(options)), key=lambda i: (options[i].cost, options[i].in_flight, options[i].routed))
    if not best:
        return best
    holder = max(best, key=lambda i: options[i].start.reused)  # the first of the longest, by cost
    if options[holder].start.reused > 0 and options[holder].cost <= options[best[0]].cost + MOVE_MARGIN:
        best.remove(holder)
        best.insert(0, holder)
    return best
