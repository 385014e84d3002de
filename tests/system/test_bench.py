"""The benchmark runs end to end in quick mode and writes its outputs (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# the benchmark reads /proc (cpuinfo, self/io, clear_refs), findmnt and posix_fadvise
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the benchmark measures through Linux's /proc")

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench.py"


def test_quick_bench_writes_its_report(tmp_path: Path, disk_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--out",
            str(out),
            "--workdir",
            str(disk_path),  # the agent workload divides by the block device's write bytes
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "benchmarks.json").read_text())
    assert report["mode"] == "quick"
    for section in ("limits", "writes", "mlx", "restore", "sizes", "large", "agent", "index", "remote"):
        assert section in report
    assert report["remote"] is not None  # the test extra installs obstore and moto: the section ran
    assert "## Scale-out over a bucket" in (out / "benchmarks.md").read_text()
    assert report["targets"] and all("met" in t for t in report["targets"])
    md = (out / "benchmarks.md").read_text()
    assert "## Targets" in md and "## Machine" in md
    assert (out / "benchmarks.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert list(disk_path.iterdir()) == []  # scratch stores removed


def test_quick_needs_an_output_directory() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2


def test_help_names_no_issue_number() -> None:
    proc = subprocess.run([sys.executable, "-m", "blockkv", "bench", "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and "usage: blockkv bench" in proc.stdout
    assert "issue" not in proc.stdout.lower() and "#" not in proc.stdout
