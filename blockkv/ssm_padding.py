"""Per-row prefill padding for recurrent (SSM) layers.

Recurrent state has no token axis to roll back, so padded positions must never
update it: each batch row carries a left padding and an end (``lengths``, in
padded positions) and only tokens in [left_padding, lengths) are real. Same
rules as mlx-lm's ``ArraysCache.make_mask``/``advance``, kept host-side so the
counts are plain ints."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def _ints(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes)) or not all(type(v) is int for v in values):
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}")
    return list(values)


def _count(n: int) -> int:
    if type(n) is not int or n < 0:
        raise ValueError(f"token count must be a non-negative int, got {n!r}")
    return n


class SsmPrefillPadding:
    """Left padding and per-row end positions of a batched prefill."""

    def __init__(self, lengths: Sequence[int], left_padding: Sequence[int] | None = None) -> None:
        self._lengths = _ints("lengths", lengths)
        if not self._lengths:
            raise ValueError("lengths must name at least one row")
        self._left = [0] * len(self._lengths) if left_padding is None else _ints("left_padding", left_padding)
        if len(self._left) != len(self._lengths):
            raise ValueError(f"left_padding has {len(self._left)} rows, lengths has {len(self._lengths)}")

    @property
    def lengths(self) -> list[int]:
        """Per-row end positions, relative to the next token to process."""
        return list(self._lengths)

    @property
    def left_padding(self) -> list[int]:
        """Per-row padding still ahead, relative to the next token to process."""
        return list(self._left)

    def convolution_lengths(self, n: int) -> list[int]:
        """Per row, how many of the next ``n`` positions lie before the row's end."""
        n = _count(n)
        return [max(0, min(n, length)) for length in self._lengths]

    def make_mask(self, n: int) -> mx.array:
        """[rows, n] bool mask of real tokens among the next ``n`` positions."""
        pos = mx.arange(_count(n))[None]
        left = mx.array(self._left)[:, None]
        ends = mx.array(self._lengths)[:, None]
        return (pos >= left) & (pos < ends)

    def advance(self, n: int) -> list[int]:
        """Consume ``n`` positions; returns each row's count of real tokens among them."""
        n = _count(n)
        counts = [
            max(0, min(n, length) - max(0, min(n, left))) for length, left in zip(self._lengths, self._left)
        ]
        self._lengths = [length - n for length in self._lengths]
        self._left = [left - n for left in self._left]
        return counts

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices ``keep`` (in that order)."""
        keep = _ints("keep", keep)
        rows = len(self._lengths)
        if not keep or not all(0 <= k < rows for k in keep):
            raise ValueError(f"keep must be non-empty row indices below {rows}, got {keep}")
        self._left = [self._left[k] for k in keep]
        self._lengths = [self._lengths[k] for k in keep]
