"""A short fleet kill -9 loop: three nodes on one bucket, gc/evict/check
--repair beside them, one node's disk rotting and the server's clock stepping
(the long form is ``python tools/fleet_killloop.py --kills 60``). It runs
until it has done its minimum work, however busy the machine; the deadline
only bounds a run that cannot get there."""

from __future__ import annotations

from pathlib import Path

from tool_scripts import load

load("mp_killloop")  # the journal and synthetic entries the fleet loop shares with it
fleet_killloop = load("fleet_killloop")

DEADLINE_S = 600.0  # generous: about 20 s on a quiet machine


def test_fleet_kill_loop_loses_nothing(tmp_path: Path) -> None:
    minimum = fleet_killloop.Minimum(kills=3, steps=2, rotted=2, acknowledged=1)
    fig = fleet_killloop.run(minimum, seed=5, workdir=tmp_path, seconds=DEADLINE_S, kill_every=3.0, step=8.0,
                             step_every=3.0, rot_every=1.5)
    print(fig)
    assert fig.kills >= 3 and fig.steps >= 2 and fig.rotted >= 2, f"minimum work not done within {DEADLINE_S} s"
    assert fig.acknowledged > 0 and fig.verified > 0
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
