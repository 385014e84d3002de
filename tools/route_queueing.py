"""Where each fleet of a ``tools/route_bench.py --json`` run queued its
requests (issue #44): read from the requests it recorded, per fleet, so a
placement's loss can be told apart from the machine's noise.

Per fleet:

- ``own``: later turns sent to the node that served their conversation's
  previous turn (a round-robin fleet keeps a conversation home only by the
  arithmetic of its rotation; by chance, 1 in nodes);
- ``busier``: requests sent to a node with more requests in flight than the
  least busy node had then, and of those ``stayed`` home (a later turn sent
  to the node of its previous turn);
- the later turns' median time to first token by the requests in flight on
  their node when they were sent (0, 1, 2 or more; streamed requests only),
  and the delay one request in flight added, ``(median with 1 - median with
  0)``, in seconds and in tokens' worth of this fleet's prefill (the idle
  later turns' median seconds over their median tokens prefilled).

    python tools/route_bench.py --window 150 --interleave 4 --pooled --json /tmp/pooled.json
    python tools/route_queueing.py /tmp/pooled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def in_flight(request: dict[str, Any], fleet: list[dict[str, Any]], node: str) -> int:
    """Requests of ``fleet`` on ``node`` in flight when ``request`` was sent."""
    t = request["sent_at"]
    return sum(1 for o in fleet if o is not request and o["node"] == node and o["sent_at"] <= t < o["sent_at"] + o["total_s"])


def fleet_figures(fleet: list[dict[str, Any]]) -> dict[str, Any]:
    nodes = sorted({r["node"] for r in fleet})
    previous: dict[int, str] = {}
    later = own = busier = stayed = 0
    by_load: dict[int, list[tuple[float, int]]] = {0: [], 1: [], 2: []}
    for r in sorted(fleet, key=lambda r: r["sent_at"]):
        load = {n: in_flight(r, fleet, n) for n in nodes}
        home = previous.get(r["session"])
        if load[r["node"]] > min(load.values()):
            busier += 1
            stayed += home == r["node"]
        if home is not None:
            later += 1
            own += home == r["node"]
            if r["stream"] and r["ttft_s"] is not None:
                by_load[min(load[r["node"]], 2)].append((r["ttft_s"], r["prompt_tokens"] - r["cached_tokens"]))
        previous[r["session"]] = r["node"]
    medians = {k: statistics.median(t for t, _ in v) if v else None for k, v in by_load.items()}
    figures = {"requests": len(fleet), "own": own / later if later else None, "busier": busier / len(fleet),
               "stayed": stayed / len(fleet), "ttft_by_in_flight": medians,
               "later_turns_by_in_flight": {k: len(v) for k, v in by_load.items()}}
    if medians[0] is not None and medians[1] is not None:
        per_token = medians[0] / statistics.median(p for _, p in by_load[0])
        figures["delay_per_in_flight_s"] = medians[1] - medians[0]
        figures["delay_per_in_flight_tokens"] = (medians[1] - medians[0]) / per_token
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="route_bench.py --json files")
    args = p.parse_args(argv)
    for path in args.runs:
        requests = json.loads(path.read_text())["requests"]
        for way, sent in requests.items():
            for number in sorted({r["fleet"] for r in sent}):
                f = fleet_figures([r for r in sent if r["fleet"] == number])
                t = f["ttft_by_in_flight"]
                delay = (f"{f['delay_per_in_flight_s']:+.2f} s ({f['delay_per_in_flight_tokens']:+.0f} tokens)"
                         if "delay_per_in_flight_s" in f else "n/a")
                print(f"{path.name} fleet {number} {way:11s} own {f['own']:.0%}, to a busier node {f['busier']:.0%} "
                      f"(stayed home {f['stayed']:.0%}); later-turn TTFT by in flight 0/1/2+: "
                      + "/".join("-" if t[k] is None else f"{t[k]:.2f}" for k in (0, 1, 2))
                      + f" s ({'/'.join(str(n) for n in f['later_turns_by_in_flight'].values())} turns); "
                      f"one in flight adds {delay}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
