"""tools/route_bench.py --quick --window --interleave --pooled (two fleets of three nodes, about a
minute on 2 shared cores): a time-boxed run counts only the requests answered
inside each fleet's window, and its per-request and per-node counts agree with
each other and with what the nodes' /metrics counted, and tools/route_queueing.py reads
the run (every streamed later turn counted once). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from tool_scripts import load


def test_quick_window_run_counts_inside_the_window_and_its_counts_agree(tmp_path: Path) -> None:
    bench = load("route_bench")
    out = tmp_path / "route.json"
    assert bench.main(["--quick", "--rounds", "1", "--window", "6", "--interleave", "2", "--pooled", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    records = {r["fleet"]: r for r in report["fleet_records"]}
    assert sorted((r["fleet"], r["way"]) for r in records.values()) == [(0, "router"), (1, "round-robin")]
    for way in bench.WAYS:
        sent = report["requests"][way]
        (record,) = [r for r in records.values() if r["way"] == way]
        inside = [s for s in sent if s["in_window"]]
        assert sent and len(inside) == report[way]["requests"]
        for s in sent:  # counted exactly when answered before its fleet's window closed
            assert s["in_window"] == (s["sent_at"] + s["total_s"] <= record["window_closed_at"])
            assert s["node"] in record["nodes"] and 0 <= s["cached_tokens"] < s["prompt_tokens"]
        assert sum(report[way][f"later_from_{w}"] for w in bench.SOURCES) == report[way]["later_turns"]
        assert sum(s["turn"] > 0 for s in inside) == report[way]["later_turns"]
        # the nodes prefilled exactly what the answers say they did not reuse, over every request sent
        counters = record["counters"].values()
        assert sum(c["tokens_prefilled"] for c in counters) == sum(s["prompt_tokens"] - s["cached_tokens"] for s in sent)
        assert sum(c[f"tokens_restored_{t}"] for c in counters for t in ("ram", "disk", "bucket")) == sum(
            s["cached_tokens"] for s in sent)
        (row,) = [f for f in report["fleets"] if f["way"] == way]
        assert sum(row["requests_by_node"]) == len(inside)
    assert set(report["fleet_records"][0]["router_health"]["nodes"]) == set(records[0]["nodes"])
    assert report["fleet_records"][1]["router_health"] is None
    queueing = load("route_queueing")
    for way in bench.WAYS:
        sent = report["requests"][way]
        figures = queueing.fleet_figures(sent)
        streamed_later = sum(1 for s in sent if s["turn"] > 0 and s["ttft_s"] is not None)
        assert figures["requests"] == len(sent) and sum(figures["later_turns_by_in_flight"].values()) == streamed_later
        assert 0 <= figures["stayed"] <= figures["busier"] <= 1
    assert queueing.main([str(out)]) == 0
