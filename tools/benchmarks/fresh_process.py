"""A restore (blockkv) or load (mlx-lm) measured in a fresh process, whose
allocator state is the same for both: its peak RSS growth and its time, which
in a long-lived process depend on what ran before. The parent side spawns the
entry point with ``--rss-child``; the entry point hands the spec to
``rss_child`` here (or, for the large-entry run, to
``large_entries.large_child``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import load_prompt_cache

from .harness import ENTRY_POINT, median_time, open_store
from .sources import eval_caches


def child_restore(spec: dict[str, Any]) -> dict[str, Any]:
    """Run a restore (blockkv) or load (mlx-lm) in a fresh process, whose allocator
    state is the same for both: the first run's time (what a restarted server's
    first hit waits for) and peak RSS growth in bytes (VmHWM after, with the peak
    reset just before, minus VmRSS before), then the median seconds of
    ``spec["reps"]`` more runs."""
    out = subprocess.run(
        [
            sys.executable,
            str(ENTRY_POINT),
            "--rss-child",
            json.dumps(spec),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def first_runs(ours: dict[str, Any], theirs: dict[str, Any], pairs: int) -> tuple[list[float], list[float]]:
    """The first restore (spec ``ours``) and mlx-lm's first load (``theirs``), each
    in ``pairs`` fresh processes, alternating, which goes first alternating too:
    a restarted server's first hit, with enough samples for a median."""
    firsts: tuple[list[float], list[float]] = ([], [])
    for i in range(pairs):
        runs = [(ours, firsts[0]), (theirs, firsts[1])]
        for spec, times in runs if i % 2 == 0 else runs[::-1]:
            times.append(child_restore({**spec, "reps": 1})["first_seconds"])
    return firsts


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_child(spec: dict[str, Any]) -> dict[str, float]:
    """The child side of ``child_restore`` for a restore or a load:
    ``{"peak_delta": bytes, "first_seconds": s, "seconds": s}``."""
    if spec["kind"] == "mlx":
        run: Callable[[], Any] = lambda: eval_caches(load_prompt_cache(spec["path"]))
    else:
        store = open_store(Path(spec["root"]), spec["block_tokens"])
        match = store.find_exact(tuple(spec["tokens"]))
        assert match is not None, "rss child: entry not found"

        def run() -> None:
            loaded = store.restore(match.entry)
            assert loaded is not None
            eval_caches(loaded.caches)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    rss_before = status_kib("VmRSS")
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    peak = (status_kib("VmHWM") - rss_before) * 1024
    return {"peak_delta": peak, "first_seconds": first, "seconds": median_time(run, spec["reps"])}
