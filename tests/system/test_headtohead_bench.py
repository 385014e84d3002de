"""tools/headtohead_bench.py --quick (~25 s on a quiet machine) runs both servers, alternated, at both RAM
points on the tiny model; its report has every figure and every answer of
blockkv serve matches mlx_lm.server's (greedy). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from tool_scripts import load


def test_quick_run_reports_both_servers_at_both_points_with_identical_answers(tmp_path: Path) -> None:
    bench = load("headtohead_bench")
    assert bench.main(["--quick", "--out", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "headtohead-bench.json").read_text())
    shape = report["shape"]
    requests = shape["sessions"] * shape["turns"]
    (result,) = report["models"]
    assert result["model"] == "demo"
    for point in ("budget", "fits"):
        p = result[point]
        assert [r["server"] for r in p["runs"]] == ["mlx_lm.server", "blockkv serve"][: shape["runs"]]
        assert p["answers"] == requests and p["answers_identical"] == requests
        for run in p["runs"]:
            assert [(r["session"], r["turn"]) for r in run["requests"]] == [
                (s, t) for t in range(1, shape["turns"] + 1) for s in range(shape["sessions"])]
            assert all(r["answer"] and r["cached_tokens"] <= r["prompt_tokens"] for r in run["requests"])
        for name in bench.SERVERS:
            f = p["per_server"][name]
            assert f["later_turns"] == requests - shape["sessions"]
            assert 0 < f["later_ttft_median_s"] <= f["later_ttft_p90_s"]
            assert 0 < f["prefilled"] <= sum(r["prompt_tokens"] for r in p["runs"][0]["requests"])
    # with room for every session each later turn finds its previous prompt in RAM, on both servers
    assert all(f["own_turn_hits"] == f["later_turns"] for f in result["fits"]["per_server"].values())
    # at the budget the RAM bound bites: mlx_lm.server has lost some session's previous turn
    plain = result["budget"]["per_server"]["mlx_lm.server"]
    assert plain["own_turn_hits"] < plain["later_turns"]
    assert (tmp_path / "headtohead-bench.png").stat().st_size > 0
    assert "mlx_lm.server" in (tmp_path / "headtohead-bench.md").read_text()
