"""blockkv.human: the units and tables every blockkv program prints and reads."""

from __future__ import annotations

import argparse

import pytest

from blockkv.human import (
    format_ms,
    format_ratio,
    format_size,
    parse_count,
    parse_seconds,
    parse_size,
    render_table,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("500M", 500 << 20), ("10G", 10 << 30), ("1.5GiB", 3 << 29),
     ("2kb", 2048), ("0", 0)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [("-5G", "negative"), ("lots", "not a size")])
def test_parse_size_refuses_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_size(text)


def test_format_size_reads_back() -> None:
    for n in (0, 1023, 1 << 20, 3 << 29, 7 << 40):
        assert parse_size(format_size(n).replace(" ", "")) == pytest.approx(n, rel=0.05)


def test_seconds_ratios_and_milliseconds() -> None:
    assert parse_seconds("0") == 0 and parse_seconds("1.5") == 1.5
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seconds(bad)
    assert format_ratio(3, 2) == "1.50x" and format_ratio(3, 0) == "-"
    assert format_ms(0.1234) == "123 ms"
    assert parse_count("256") == 256
    for bad, message in (("0", "at least 1"), ("1.5", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_count(bad)


def test_render_table_aligns_numbers_right_and_can_underline_the_header() -> None:
    rows = [["a", "12"], ["long name", "3"]]
    assert render_table(["NAME", "N"], rows, right={1}).splitlines() == [
        "NAME        N", "a          12", "long name   3",
    ]
    assert render_table(["NAME", "N"], rows, right={1}, rule=True).splitlines()[1] == "---------  --"
