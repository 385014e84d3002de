"""How fast the command line tool and the library start: ``blockkv --help``,
``ls`` and ``stats`` of a small root, ``import blockkv`` and the import a
library user makes (``from blockkv import BlockStore``), each a fresh process,
against ``python -c "import mlx_lm"`` (what every command paid before, through
transformers) and ``import mlx.core`` (what a restore needs), alternating rep
by rep. The same figures anyone can take with::

    hyperfine -w 2 'python -c "import mlx_lm"' 'blockkv ls ROOT' 'blockkv stats ROOT' 'blockkv --help'
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .config import Config
from .harness import REPO, open_store
from .sources import KVSource

BASELINE = "python -c 'import mlx_lm'"


def commands(root: Path) -> dict[str, list[str]]:
    """What each figure runs, as users run it (``python -m blockkv`` is the console script)."""
    py = sys.executable
    return {
        BASELINE: [py, "-c", "import mlx_lm"],
        "python -c 'import mlx.core'": [py, "-c", "import mlx.core"],
        "blockkv --help": [py, "-m", "blockkv", "--help"],
        "blockkv ls ROOT": [py, "-m", "blockkv", "ls", str(root)],
        "blockkv stats ROOT": [py, "-m", "blockkv", "stats", str(root)],
        "python -c 'import blockkv'": [py, "-c", "import blockkv"],
        "python -c 'from blockkv import BlockStore'": [py, "-c", "from blockkv import BlockStore"],
    }


def bench_cli_start(cfg: Config, work: Path) -> dict[str, Any]:
    """Median wall time of each command over ``2 * reps - 1`` alternating rounds
    (after one warm-up round), and the load average around them."""
    root = work / "cli-start"
    src = KVSource.random(cfg.index_shape, 3 * 64, seed=11)
    with open_store(root, cfg.block_tokens) as store:
        for i in range(3):
            assert store.store(src.tokens[: 64 * (i + 1)], src.caches(64 * (i + 1))), "cli-start store refused"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmds = commands(root)
    runs: dict[str, list[float]] = {k: [] for k in cmds}
    load_before = os.getloadavg()
    for rep in range(2 * cfg.reps):
        for name, argv in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
            if rep:  # the first round warms the page cache
                runs[name].append(time.perf_counter() - t0)
    return {
        "seconds": {k: statistics.median(v) for k, v in runs.items()},
        "reps": len(runs[BASELINE]),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def cli_start_markdown(cs: dict[str, Any]) -> list[str]:
    """The section of benchmarks.md: each command's start against importing mlx-lm."""
    base = cs["seconds"][BASELINE]
    load = " / ".join(", ".join(f"{x:.2f}" for x in cs[k]) for k in ("loadavg_before", "loadavg_after"))
    return [
        "## Starting the tool and the library",
        "",
        (
            f"Each command in a fresh process, alternating, median of {cs['reps']} (after a warm-up round); "
            f"`ROOT` holds 3 tiny entries. Load average before / after (1, 5, 15 min): {load}. The ratio is "
            "against importing mlx-lm, which every command paid before (blockkv's cache kinds imported it, and "
            "it imports transformers). The same with hyperfine: `hyperfine -w 2 'python -c \"import mlx_lm\"' "
            "'blockkv ls ROOT' 'blockkv stats ROOT' 'blockkv --help'`."
        ),
        "",
        "| command | median | / `import mlx_lm` |",
        "|---|---|---|",
        *(f"| `{k}` | {v * 1e3:.0f} ms | {v / base:.2f}x |" for k, v in cs["seconds"].items()),
        "",
    ]
