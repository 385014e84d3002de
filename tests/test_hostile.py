"""Bad input: the header and block parsers take untrusted bytes from disk.
Whatever the bytes, the verdict is a clean CorruptError: never another
exception, a hang or an allocation out of proportion to the input."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from blockkv.errors import CorruptError
from blockkv.header import MAGIC, VERSION, Header, Identity, decode_header, encode_header

_FIXED = struct.Struct("<8sHHII")
_IDENTITY = Identity("m", "fp", "tok", "codec")


def _valid_header(tokens: list[int], descriptor: dict[str, Any]) -> bytes:
    return encode_header(Header(_IDENTITY, "", np.array(tokens, np.uint32), descriptor))


def _sealed(body: bytes) -> bytes:
    """Append a correct digest, so the parser gets past its checksum."""
    return body + blake3.blake3(body).digest()


def _bounded(parse: Callable[[bytes], object], data: bytes) -> None:
    """``parse(data)`` either succeeds or says corrupt, and its peak allocation
    stays proportional to the input (no trusting a declared size)."""
    tracemalloc.start()
    try:
        parse(data)
    except CorruptError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= 8 * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte input"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@given(st.binary(max_size=512))
def test_random_bytes_are_a_corrupt_header(data: bytes) -> None:
    _bounded(decode_header, data)


@given(st.binary(max_size=512))
def test_random_bytes_behind_a_valid_magic_are_a_corrupt_header(tail: bytes) -> None:
    _bounded(decode_header, MAGIC + struct.pack("<H", VERSION) + tail)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=20), st.data())
def test_truncated_or_flipped_header_is_corrupt(tokens: list[int], data: st.DataObject) -> None:
    good = _valid_header(tokens, {"records": []})
    decode_header(good)
    cut = data.draw(st.integers(0, len(good) - 1))
    _bounded(decode_header, good[:cut])
    at = data.draw(st.integers(0, len(good) - 1))
    flipped = bytearray(good)
    flipped[at] ^= data.draw(st.integers(1, 255))
    try:
        decode_header(bytes(flipped))
    except CorruptError:
        return
    raise AssertionError(f"a flipped byte at {at} went unnoticed")


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=64))
def test_huge_declared_sizes_are_refused_without_allocating(
    meta_len: int, n_tokens: int, tail: bytes
) -> None:
    body = _FIXED.pack(MAGIC, VERSION, 0, meta_len, n_tokens) + tail
    _bounded(decode_header, _sealed(body))


@given(json_values)
def test_sealed_header_with_hostile_metadata_is_parsed_or_corrupt(meta: Any) -> None:
    """A checksum only proves the bytes are whole, not that a writer was sane."""
    meta_bytes = json.dumps(meta).encode()
    body = _FIXED.pack(MAGIC, VERSION, 0, len(meta_bytes), 0) + meta_bytes
    _bounded(decode_header, _sealed(body))
