"""Entries written under one mlx-lm version restore, bit for bit, under
another. Needs two Pythons, so it is not in the default suite: CI's second
venv (the oldest mlx-lm the pyproject allows) runs it by path, with
``BLOCKKV_OTHER_PYTHON`` naming the first venv's Python (the newest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NODE = Path(__file__).parents[1] / "support" / "version_node.py"


def run(python: str, mode: str, root: Path) -> str:
    out = subprocess.run([python, str(NODE), mode, str(root)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("direction", ["this-writes", "other-writes"])
def test_entries_restore_across_mlx_lm_versions(tmp_path: Path, direction: str) -> None:
    other = os.environ.get("BLOCKKV_OTHER_PYTHON")
    assert other, "set BLOCKKV_OTHER_PYTHON to the Python of another mlx-lm version"
    writer, reader = (sys.executable, other) if direction == "this-writes" else (other, sys.executable)
    root = tmp_path / "cache"
    root.mkdir()
    run(writer, "write", root)
    assert "differing: []" in run(reader, "read", root)
