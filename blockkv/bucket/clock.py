"""The server's clock, checked against ours: the bucket protocol compares
only server times (``Last-Modified``), so its safety rests on that clock
running at real speed while a store or a GC run is in progress. A reading
pairs a server time with the local monotonic times of the request that
produced it; two readings whose server times moved apart by more than the
local monotonic clock allows show a step (docs/scale-out.md, "A stepping
server clock").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Last-Modified has one-second resolution (an HTTP date): every comparison of
# server times gives this much away, always in the safe direction
CLOCK_SLACK = 1.0


@dataclass(frozen=True)
class Reading:
    """A server time, stamped while a request of ours was in flight."""

    server: float  # seconds since the epoch, as the server's Last-Modified says
    sent: float  # time.monotonic() before the request
    answered: float  # time.monotonic() once it answered


def read_clock(request: object) -> Reading:
    """Run ``request()`` (a callable returning a server time) and time it locally."""
    sent = time.monotonic()
    server = request()  # type: ignore[operator]
    return Reading(server, sent, time.monotonic())


def precise(a: Reading, b: Reading) -> bool:
    """Were both readings quick enough (together under a second) to bound a step?"""
    return (a.answered - a.sent) + (b.answered - b.sent) < CLOCK_SLACK


def no_forward_step(a: Reading, b: Reading) -> bool:
    """Did the server's clock advance from ``a`` to ``b`` by no more than real
    time allows? Each server time was stamped while its request was in flight
    and is cut to the second, so with precise readings a forward step of more
    than 2 s shows; a smaller one is within the margins the protocol keeps.
    Imprecise readings prove nothing: False, and the caller takes the safe path."""
    return precise(a, b) and b.server - a.server <= b.answered - a.sent + CLOCK_SLACK


def no_backward_step(a: Reading, b: Reading) -> bool:
    """Did the server's clock advance from ``a`` to ``b`` by at least the real
    time that surely passed (less a second for the cut, and one more)? A
    backward step of more than 2 s shows whatever the requests took."""
    return b.server - a.server >= b.sent - a.answered - 2 * CLOCK_SLACK
