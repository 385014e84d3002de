"""``--cache-bytes 10%``: a disk tier's cap as a share of the disk it is on.

A fixed cap does not follow a laptop's disk as it fills and empties; a share
does. The share is of the space the store may have, what it holds plus what
is free on the file system holding the root, read again (one ``statvfs``)
each time the store checks its cap (at every store and eviction). So the cap
shrinks as other files fill the disk and grows as they go, and it never
falls below a floor: a full disk still keeps a working set (a store that
cannot write then degrades to "not stored", as on any full disk).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blockkv.human import format_size, parse_cap

FLOOR_BYTES = 1 << 30  # the least a share ever allows: a few long conversations of a small model


@dataclass(frozen=True)
class DiskShare:
    """``fraction`` (0 < fraction <= 1) of what the store holds plus the free
    space under its root, and at least ``floor`` bytes."""

    fraction: float
    floor: int = FLOOR_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"a share of the disk must be in (0%, 100%], got {self.fraction:.4%}")

    def cap(self, root: str | os.PathLike[str], held: int) -> int:
        """The cap now for a store holding ``held`` bytes under ``root``."""
        st = os.statvfs(root)
        return max(self.floor, int(self.fraction * (held + st.f_bavail * st.f_frsize)))

    def limit(self, root: Path, held: Callable[[], int]) -> Callable[[], int]:
        """A ``BlockStore(limit=...)`` callable for a store under ``root``;
        ``held`` says how much it holds (0 while it opens)."""
        return lambda: self.cap(root, held())

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}% of the disk"


def parse_budget(text: str) -> int | DiskShare:
    """``--cache-bytes``: a size (``20G``) or a share of the disk (``10%``)."""
    if not text.strip().endswith("%"):
        return parse_cap(text)
    try:
        return DiskShare(float(text.strip()[:-1]) / 100)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a share of the disk: {text!r} ({e})") from None


def describe(budget: int | DiskShare, root: Path, held: int) -> str:
    """What a budget means for ``root`` holding ``held`` bytes now, for the log line at start."""
    if isinstance(budget, int):
        return f"{format_size(budget)} per model"
    try:
        now = format_size(budget.cap(root, held))
    except OSError as e:
        now = f"unknown now: {e.strerror or e}"
    return f"{budget} per model ({now} now, at least {format_size(budget.floor)})"
