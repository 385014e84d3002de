"""Sizes, times and tables as people type and read them.

One place for the units of every program blockkv ships (``blockkv`` itself,
``blockkv serve``, ``blockkv demo``), so ``10G`` means the same bytes and a
table lines up the same way in each.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from datetime import datetime

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``500M``, ``10G``, ``1.5GiB`` (binary units, like ``du -h``).
    Raises ``argparse.ArgumentTypeError`` so it serves as an argparse ``type``."""
    match = _SIZE_RE.match(text.strip())
    if match is None:
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"size must not be negative, got {text!r}")
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (expected e.g. 4096, 500M, 10G)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def parse_cap(text: str) -> int:
    """A byte cap: a size of at least one byte (``0`` or ``0.4`` would make a
    store that can hold nothing)."""
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a byte cap must be at least 1 byte, got {text!r}")
    return value


def parse_seconds(text: str) -> float:
    """A non-negative number of seconds (a negative grace would delete blocks a
    writer in another process may be about to reference)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must not be negative, got {text!r}")
    return value


def parse_wait(text: str) -> float:
    """``parse_seconds``, finite: how long a command waits for a lock (every
    wait is bounded; "forever" is not a bound)."""
    value = parse_seconds(text)
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"a wait must be a finite number of seconds, got {text!r}")
    return value


def parse_count(text: str) -> int:
    """A whole number of at least 1 (tokens, entries)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_option(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (a ``--remote-option``) as a pair; an argparse ``type``."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text!r}")
    return key.strip(), value


def format_size(n: int) -> str:
    """Human bytes in the same binary units ``parse_size`` reads."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"


def format_time(t: float | None) -> str:
    """Local wall-clock time to the second; ``-`` when there is none."""
    if not t:
        return "-"
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def format_ms(seconds: float) -> str:
    """A duration in whole milliseconds (time to first token, restore times)."""
    return f"{seconds * 1000:.0f} ms"


def format_ratio(numerator: int, denominator: int) -> str:
    """``2.35x``; ``-`` when the denominator is zero."""
    return f"{numerator / denominator:.2f}x" if denominator else "-"


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int], *, rule: bool = False
) -> str:
    """Plain aligned columns; ``right`` holds the indexes of numeric columns;
    ``rule`` underlines the header with dashes."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    dashes = [line(["-" * w for w in widths])] if rule else []
    return "\n".join([line(headers), *dashes, *(line(r) for r in rows)])
