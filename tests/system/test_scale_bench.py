"""The scale benchmark runs end to end in quick mode (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# the benchmark reads /proc/self/status and drops files from the page cache with posix_fadvise
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the benchmark measures through Linux's /proc")

BENCH = Path(__file__).resolve().parents[2] / "tools" / "scale_bench.py"


def test_quick_scale_bench_measures_every_row(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    sizes = report["workload"]["sizes"]
    assert [row["entries"] for row in report["rows"]] == sizes
    assert sizes[-1] > report["workload"]["stored_max"]  # the quick run clones headers too
    for row in report["rows"]:
        for key in ("open_valid_s", "open_reboot_s", "open_rebuild_s", "find_hit_p99_ms", "find_new_p99_ms",
                    "store_p99_ms", "gc_s", "check_s", "ls_s", "stats_s", "anon_delta",
                    "fleet_first_open_s", "fleet_later_open_s"):
            assert row[key] > 0, key
        assert row["gc_blocks"] > 0  # the stores it timed were removed and their blocks collected
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # the scratch roots removed
