"""A short multi-process kill -9 loop (the full one is ``python tools/mp_killloop.py --kills 200``)."""

from __future__ import annotations

from pathlib import Path

from tool_scripts import load

mp_killloop = load("mp_killloop")


def test_mp_kill_loop_loses_nothing(store_root: Path) -> None:
    fig = mp_killloop.run(kills=4, workers=3, seed=3, root=store_root, seconds=120, verify_every=8)
    assert fig.kills == 4
    assert fig.acknowledged > 0 and fig.verified > 0
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
