"""``blockkv demo``: runs offline on a real (tiny) mlx-lm model and reports figures
measured in the run: disk reuse after the restart, every entry found again,
greedy output identical to a cold prefill, deduplicated bytes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from blockkv.mlx_lm import demo

SMALL = ["--sessions", "2", "--turns", "2", "--system-words", "600", "--user-words", "8", "--max-tokens", "4"]
COLUMNS = ("requests", "prompt tok", "prefilled", "from RAM", "from disk")


def _row(out: str, phase: str) -> dict[str, int]:
    line = next(line for line in out.splitlines() if line.startswith(phase))
    cells = re.split(r"\s{2,}", line.strip())
    return dict(zip(COLUMNS, map(int, cells[1:6])))


def _check_report(out: str, sessions: int, turns: int, cold_checks: int) -> None:
    first, restart = _row(out, "first run"), _row(out, "after restart")
    assert first["requests"] == sessions * turns and restart["requests"] == sessions + 1
    for row in (first, restart):
        assert row["prefilled"] + row["from RAM"] + row["from disk"] == row["prompt tok"]
    # The restarted process's RAM tier starts empty: the first new session reads the
    # shared system prompt from disk, later ones from RAM or (their own history) disk.
    assert restart["from disk"] > restart["prefilled"]
    found = re.search(r"restart: (\d+)/(\d+) entries found again", out)
    assert found is not None and found.group(1) == found.group(2) == str(sessions * turns)
    assert f"greedy output identical to a cold prefill: {cold_checks}/{cold_checks}" in out
    sizes = re.search(r"bytes on disk: .* one file per entry would take .* \((\d+\.\d)x smaller\)", out)
    assert sizes is not None and float(sizes.group(1)) > 1.0
    assert re.search(r"cold prefill \d+ ms vs after restart \d+ ms", out)


def test_cli_demo_runs_offline_and_reports_measured_figures() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "blockkv", "demo", *SMALL, "--cold-checks", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    _check_report(out.stdout, sessions=2, turns=2, cold_checks=1)
    assert "blockkv demo" in out.stderr and "req" in out.stderr  # the tqdm progress bar


def test_cache_dir_is_kept_and_reused_by_the_next_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache_dir = tmp_path / "cache"
    assert demo.main([*SMALL, "--cold-checks", "0", "--cache-dir", str(cache_dir)]) == 0
    first = capsys.readouterr().out
    assert _row(first, "first run")["from disk"] == 0
    assert [d.name.split("_")[0] for d in cache_dir.iterdir() if d.is_dir()] == ["tiny-llama-demo"]  # not "model"
    # Same seed, same weights, same identity: the second run starts warm from disk.
    assert demo.main([*SMALL, "--cold-checks", "0", "--cache-dir", str(cache_dir)]) == 0
    second = capsys.readouterr().out
    assert "first run" not in second  # it is not one: its prompts come from disk
    assert _row(second, "rerun (warm disk)")["from disk"] > 0
    assert "cold, no cache" not in second


def test_local_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from blockkv.model_dir import build_model_dir

    model = build_model_dir(tmp_path / "local-model", "llama", seed=3)
    assert demo.main([*SMALL, "--cold-checks", "1", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"model: {model}" in out
    _check_report(out, sessions=2, turns=2, cold_checks=1)


def test_real_model(real_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--real-model: the same demo on SmolLM2-135M-Instruct (the session's build). The
    CPU prefills it at a few tokens a second, so the prompts here are shorter than
    the one block a restore from disk needs: this checks the run, the entry found
    again and the greedy output; restores on this model are tests/system/test_serve_real_model.py's."""
    argv = ["--real-model", "--sessions", "1", "--turns", "1", "--system-words", "5", "--user-words", "2",
            "--max-tokens", "2", "--cold-checks", "1"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "model: SmolLM2-135M-Instruct 4-bit (blockkv.real_model)" in out
    assert "restart: 1/1 entries found again; greedy output identical to a cold prefill: 1/1" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sessions", "0"], "--sessions must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--system-words", "-1"], "--system-words must be >= 0"),
        (["--model", "/nonexistent/model"], "not an mlx-lm model directory"),
        (["--model", "/nonexistent/model", "--real-model"], "not allowed with argument --model"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_default_demo() -> None:
    """The README's first command, with its defaults (about half a minute on 2 cores)."""
    out = subprocess.run(
        [sys.executable, "-m", "blockkv", "demo"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    _check_report(out.stdout, sessions=4, turns=3, cold_checks=2)
