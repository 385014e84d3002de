"""A short multi-process kill -9 loop (the full one is ``python tools/mp_killloop.py --kills 200``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "tools" / "mp_killloop.py"
_spec = importlib.util.spec_from_file_location("mp_killloop", _PATH)
assert _spec and _spec.loader
mp_killloop = importlib.util.module_from_spec(_spec)
sys.modules["mp_killloop"] = mp_killloop
_spec.loader.exec_module(mp_killloop)


def test_mp_kill_loop_loses_nothing(store_root: Path) -> None:
    fig = mp_killloop.run(kills=4, workers=3, seed=3, root=store_root, seconds=120, verify_every=8)
    assert fig.kills == 4
    assert fig.acknowledged > 0 and fig.verified > 0
    assert (fig.lost, fig.wrong, fig.problems) == (0, 0, [])
