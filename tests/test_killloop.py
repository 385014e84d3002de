"""A short kill -9 loop (the full one is ``python tools/killloop.py --kills 200``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "tools" / "killloop.py"
_spec = importlib.util.spec_from_file_location("killloop", _PATH)
assert _spec and _spec.loader
killloop = importlib.util.module_from_spec(_spec)
sys.modules["killloop"] = killloop
_spec.loader.exec_module(killloop)


def test_kill_loop_loses_nothing(store_root: Path) -> None:
    fig = killloop.run(kills=3, seed=7, root=store_root, max_delay=1.0)
    assert fig.kills == 3
    assert fig.acknowledged > 0
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
    assert fig.verified > 0
