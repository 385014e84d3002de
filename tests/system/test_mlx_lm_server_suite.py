"""mlx-lm 0.32.2's own tests/test_server.py (tools/mlx_lm_server_suite.py, its
draft-model server served alone as mlx_lm.server --draft-model serves it): what
passes on plain mlx-lm passes on blockkv serve, fresh and restarted (restoring
from the disk), and every insert of the served model reaches the disk. The
tool's restart at the default --min-restore-tokens is left to the tool (time)."""

from __future__ import annotations

from pathlib import Path

from tool_scripts import load


def test_mlx_lms_own_server_tests_pass_on_blockkv_serve_and_every_insert_reaches_the_disk(tmp_path: Path) -> None:
    suite = load("mlx_lm_server_suite")
    restart = "blockkv restarted --min-restore-tokens 1"
    results = suite.run_all(tmp_path, draft_served_alone=True, runs=("plain", "blockkv fresh", restart))
    plain = results["plain"]["outcomes"]
    assert sum(outcome == "passed" for outcome in plain.values()) >= len(plain) // 2  # the suite ran, on mlx-lm too
    assert suite.regressions(results) == []
    assert suite.lost_inserts(results) == {"blockkv fresh": [], restart: []}
    for run in ("blockkv fresh", restart):
        counts = results[run]["counts"]
        assert counts["inserts_by_caches"].get("4", 0) > 0  # model + draft entries, not the model's alone
        assert results[run]["disk_entries"] > 0
    assert results[restart]["counts"]["tier_stats"]["disk_hits"] > 0
