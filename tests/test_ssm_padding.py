"""SsmPrefillPadding agrees with mlx-lm's ArraysCache on the same padding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache

from blockkv.ssm_padding import SsmPrefillPadding

rows = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20)), min_size=1, max_size=4)


def reference(left: list[int], lengths: list[int]) -> ArraysCache:
    cache = ArraysCache(1, left_padding=left)
    cache.left_padding = mx.array(left)  # mlx-lm drops an all-zero list
    cache.prepare(lengths=lengths)
    return cache


@given(rows, st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_mask_and_advance_match_arrays_cache(spec: list[tuple[int, int]], steps: list[int]) -> None:
    left = [lp for lp, _ in spec]
    lengths = [lp + n for lp, n in spec]
    pad = SsmPrefillPadding(lengths, left)
    ref = reference(left, lengths)
    real = [0] * len(spec)
    for n in steps:
        mask = np.array(ref.make_mask(n))
        assert np.array_equal(np.array(pad.make_mask(n)), mask)
        counts = pad.advance(n)
        assert counts == mask.sum(axis=1).tolist()
        real = [r + c for r, c in zip(real, counts)]
        ref.advance(n)
        assert pad.left_padding == np.array(ref.left_padding).tolist()
        assert pad.lengths == np.array(ref.lengths).tolist()
    total = sum(steps)
    full = np.array(reference(left, lengths).make_mask(total)).sum(axis=1).tolist()
    assert real == full


def test_convolution_lengths_and_filter() -> None:
    pad = SsmPrefillPadding([5, 2, 9], [1, 0, 4])
    assert pad.convolution_lengths(4) == [4, 2, 4]
    pad.filter([2, 0])
    assert pad.lengths == [9, 5] and pad.left_padding == [4, 1]
    assert np.array(pad.make_mask(6)).tolist() == [
        [False, False, False, False, True, True],
        [False, True, True, True, True, False],
    ]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rows"):
        SsmPrefillPadding([3, 4], [1])
    with pytest.raises(TypeError, match="lengths"):
        SsmPrefillPadding([3.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token count"):
        SsmPrefillPadding([3]).advance(-1)
    with pytest.raises(ValueError, match="keep"):
        SsmPrefillPadding([3]).filter([1])
