"""A short kill -9 loop (the full one is ``python tools/killloop.py --kills 200``)."""

from __future__ import annotations

from pathlib import Path

from tool_scripts import load

killloop = load("killloop")


def test_kill_loop_loses_nothing(store_root: Path) -> None:
    fig = killloop.run(kills=3, seed=7, root=store_root, max_delay=1.0)
    assert fig.kills == 3
    assert fig.acknowledged > 0
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
    assert fig.verified > 0
