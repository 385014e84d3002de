"""Bad input: the header and block parsers take untrusted bytes from disk.
Whatever the bytes, the verdict is a clean CorruptError: never another
exception, a hang or an allocation out of proportion to the input."""

from __future__ import annotations

import functools
import json
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockkv.errors import CorruptError
from blockkv.format.blocks import split_entry
from blockkv.format.codec import tensor_from_descriptor
from blockkv.format.descriptor import validate_descriptor
from blockkv.format.frame import _HEADER as _BLOCK_HEADER
from blockkv.format.frame import _ZSTD_MAX_RATIO, COMPRESSIONS, FRAME_VERSION, decode_block, encode_block
from blockkv.format.frame import MAGIC as BLOCK_MAGIC
from blockkv.format.header import MAGIC, VERSION, Header, Identity, decode_header, encode_header

_FIXED = struct.Struct("<8sHHII")
_IDENTITY = Identity("m", "fp", "tok", "codec")


def _valid_header(tokens: list[int], descriptor: dict[str, Any]) -> bytes:
    return encode_header(Header(_IDENTITY, "", np.array(tokens, np.uint32), descriptor))


def _sealed(body: bytes) -> bytes:
    """Append a correct digest, so the parser gets past its checksum."""
    return body + blake3.blake3(body).digest()


def _bounded(parse: Callable[[bytes], object], data: bytes, ratio: int = 8) -> None:
    """``parse(data)`` either succeeds or says corrupt, and its peak allocation
    stays proportional to the input (``ratio`` times it: no trusting a declared size)."""
    tracemalloc.start()
    try:
        parse(data)
    except CorruptError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= ratio * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte input"


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


# -- blocks --------------------------------------------------------------------

_NAME = "ab" * 32


@functools.cache
def _real_blocks(compression: str | None) -> tuple[tuple[str, bytes], ...]:
    """Framed blocks of a real llama cache (several token blocks and a layout)."""
    from blockkv.testing.strategies import make_caches

    layout = split_entry(make_caches("llama", list(range(9))), block_tokens=4)
    return tuple((b.ref.name, b"".join(bytes(p) for p in encode_block(b, compression))) for b in layout.blocks)


def _bounded_block(name: str, data: bytes) -> None:
    """A block decodes or is corrupt, allocating at most what zstd could legally
    expand its input to (the block layer's own ratio bound)."""
    _bounded(lambda d: decode_block(name, d), data, ratio=_ZSTD_MAX_RATIO)


@given(st.binary(max_size=512))
def test_random_bytes_are_a_corrupt_block(data: bytes) -> None:
    _bounded_block(_NAME, data)


@given(st.sampled_from((None, "zstd")), st.data())
def test_truncated_flipped_or_misnamed_block_is_corrupt(compression: str | None, data: st.DataObject) -> None:
    name, good = data.draw(st.sampled_from(_real_blocks(compression)))
    decode_block(name, good)
    cut = data.draw(st.integers(0, len(good) - 1))
    _bounded_block(name, good[:cut])
    flipped = bytearray(good)
    at = data.draw(st.integers(0, len(good) - 1))
    flipped[at] ^= data.draw(st.integers(1, 255))
    for bad_name, bad in ((name, bytes(flipped)), (_NAME, good)):
        try:
            decode_block(bad_name, bad)
        except CorruptError:
            continue
        raise AssertionError(f"decode_block accepted damaged input (flip at {at})")


@given(
    st.sampled_from((None, "zstd")),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=128),
)
def test_block_frame_declaring_huge_sizes_is_corrupt(
    compression: str | None, raw: int, layout_len: int, tail: bytes
) -> None:
    frame = _BLOCK_HEADER.pack(BLOCK_MAGIC, FRAME_VERSION, COMPRESSIONS[compression], 0, raw, layout_len)
    _bounded_block(_NAME, frame + tail)


def test_a_tensor_whose_size_overflows_64_bits_is_too_large() -> None:
    """Eight dimensions of 2**31 are 2**248 elements: the size bound must see
    that number, not one wrapped to 64 bits (it wrapped to 0, and passed)."""
    huge = {"dtype": "float16", "shape": [1 << 31] * 8, "token_axis": True, "token_start": 0}
    with pytest.raises(CorruptError, match="too large"):
        tensor_from_descriptor(huge)


@given(json_values)
def test_hostile_descriptor_is_valid_or_corrupt(obj: Any) -> None:
    try:
        validate_descriptor(obj)
    except CorruptError:
        pass


@given(st.data())
def test_mutated_real_descriptor_is_valid_or_corrupt(data: st.DataObject) -> None:
    """Replace one leaf of a real descriptor with a hostile value."""
    from blockkv.testing.strategies import make_caches

    desc = json.loads(json.dumps(split_entry(make_caches("cachelist", list(range(6))), 4).descriptor))
    node: Any = desc
    while isinstance(node, (dict, list)) and node:
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        if not isinstance(node[key], (dict, list)) or not node[key] or data.draw(st.booleans()):
            node[key] = data.draw(json_values)
            break
        node = node[key]
    try:
        validate_descriptor(desc)
    except CorruptError:
        pass
