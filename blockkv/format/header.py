"""Header files: the entry itself, small, self-checking, parsed with bounds.

Layout (all integers little-endian)::

    0   8  magic  b"BKVHDR\\x00\\x00"
    8   2  u16 format version (1)
    10  2  u16 reserved, 0
    12  4  u32 meta_len  (bytes of the JSON object below)
    16  4  u32 n_tokens
    20  meta_len          UTF-8 JSON object (identity, ns, descriptor, checkpoint)
    ..  4 * n_tokens      tokens, u32
    ..  32                blake3 digest of every byte before it

The framing (magic, version, the two sizes, the trailing digest) is the same
in every version, so a reader can tell a later format's whole header from a
damaged one. The JSON object holds no tensor data and no numbers that grow with the
prompt: tokens are binary. The digest covers the whole file, so a torn or
bit-flipped header is detected before anything in it is trusted.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from blockkv.errors import CorruptHeaderError, NewerFormatError

MAGIC = b"BKVHDR\x00\x00"
VERSION = 1
SUFFIX = ".bkv"
_FIXED = struct.Struct("<8sHHII")
_DIGEST = 32
MAX_META_BYTES = 16 << 20
MAX_TOKENS = 1 << 24
MAX_HEADER_BYTES = _FIXED.size + MAX_META_BYTES + 4 * MAX_TOKENS + _DIGEST
_IDENTITY_KEYS = ("model_id", "config_fingerprint", "tokenizer_hash", "codec")


@dataclass(frozen=True)
class Identity:
    """Who may read an entry: a header naming anything else is foreign."""

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str
    codec: str

    def digest(self) -> str:
        """A short stable name for this identity (the index tags records with it)."""
        fields = "\x00".join((self.model_id, self.config_fingerprint, self.tokenizer_hash, self.codec))
        return blake3.blake3(fields.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Header:
    identity: Identity
    ns: str
    tokens: np.ndarray  # uint32, read-only
    descriptor: dict[str, Any]  # the block layer's entry layout (records + block refs)
    checkpoint: dict[str, Any] | None = None
    # xxh3-128 of each block (token blocks, then state blocks, descriptor order): the
    # fast per-read check; absent in headers written before it existed
    block_xxh3: list[str] | None = None


def encode_header(header: Header) -> bytes:
    meta = {
        **{k: getattr(header.identity, k) for k in _IDENTITY_KEYS},
        "ns": header.ns,
        "descriptor": header.descriptor,
        "checkpoint": header.checkpoint,
    }
    if header.block_xxh3 is not None:
        meta["block_xxh3"] = header.block_xxh3
    meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    tokens = np.ascontiguousarray(header.tokens, dtype="<u4")
    if len(meta_bytes) > MAX_META_BYTES or len(tokens) > MAX_TOKENS:
        raise ValueError("header too large: too many tokens or blocks for one entry")
    body = b"".join(
        (_FIXED.pack(MAGIC, VERSION, 0, len(meta_bytes), len(tokens)), meta_bytes, tokens.tobytes())
    )
    return body + blake3.blake3(body).digest()


def decode_header(data: bytes) -> Header:
    """Parse and verify a header; anything malformed raises CorruptHeaderError,
    a later format NewerFormatError (not corruption: it may be perfectly good)."""
    if len(data) < _FIXED.size + _DIGEST:
        raise CorruptHeaderError(f"header truncated ({len(data)} bytes)")
    magic, version, _, meta_len, n_tokens = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CorruptHeaderError("not a blockkv header (bad magic)")
    if version < VERSION:
        raise CorruptHeaderError(f"unsupported header version {version}")
    if meta_len > MAX_META_BYTES or n_tokens > MAX_TOKENS:
        raise CorruptHeaderError("header declares absurd sizes")
    if len(data) != _FIXED.size + meta_len + 4 * n_tokens + _DIGEST:
        raise CorruptHeaderError("header length does not match its declared sizes")
    body = memoryview(data)[:-_DIGEST]
    if blake3.blake3(body).digest() != data[-_DIGEST:]:
        raise CorruptHeaderError("header checksum mismatch")
    if version > VERSION:  # whole, by the framing every version keeps: a newer blockkv's, not damage
        raise NewerFormatError(f"header format {version} is newer than this blockkv reads ({VERSION})")
    try:
        meta = json.loads(bytes(body[_FIXED.size : _FIXED.size + meta_len]))
        identity = Identity(*(_str(meta, k) for k in _IDENTITY_KEYS))
        ns = _str(meta, "ns")
        descriptor = meta["descriptor"]
        checkpoint = meta.get("checkpoint")
        block_xxh3 = meta.get("block_xxh3")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptHeaderError(f"header metadata unreadable: {exc}") from None
    if not isinstance(descriptor, dict) or not (checkpoint is None or isinstance(checkpoint, dict)) or not (
            block_xxh3 is None or isinstance(block_xxh3, list)):
        raise CorruptHeaderError("header metadata has the wrong shape")
    tokens = np.frombuffer(body, dtype="<u4", count=n_tokens, offset=_FIXED.size + meta_len)
    return Header(identity, ns, tokens, descriptor, checkpoint, block_xxh3)


def framed_tokens(data: bytes) -> np.ndarray | None:
    """A header's tokens by its framing alone (magic, version, sizes; no JSON
    parsed, no digest checked), as a view of ``data``; None if the framing is
    not a header's. For a reader that checks them against what it already
    knows of them (the catalog's digest of the indexed tokens, catalog.py)."""
    if len(data) < _FIXED.size + _DIGEST:
        return None
    magic, version, _, meta_len, n_tokens = _FIXED.unpack_from(data)
    if magic != MAGIC or version != VERSION or len(data) != _FIXED.size + meta_len + 4 * n_tokens + _DIGEST:
        return None
    return np.frombuffer(data, dtype="<u4", count=n_tokens, offset=_FIXED.size + meta_len)


def _str(meta: dict[str, Any], key: str) -> str:
    value = meta[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} is not a string")
    return value


# -- the fleet seal: a keyed MAC a bucket's writers add (bucket/fleet_key.py) --------------
# A sealed header's JSON object ends with one more member, ``"fleet_mac":"<64 hex>"``,
# appended after the last member its writer encoded; the trailing digest covers it. The MAC
# is over the header as it was before sealing, which ``unsealed`` rebuilds byte for byte
# whatever other members it has, so a reader of any later version can check it. Readers
# that do not know the member ignore it, like any JSON member they do not read.
_SEAL_HEAD = b',"fleet_mac":"'
_SEAL_LEN = len(_SEAL_HEAD) + 64 + 2  # the member, its closing quote and the object's brace


def sealed(data: bytes, mac_hex: str) -> bytes:
    """``data`` (an unsealed header: whole framing, digest matching) with the
    member ``fleet_mac`` appended to its JSON object and its digest recomputed."""
    magic, version, reserved, meta_len, n_tokens = _FIXED.unpack_from(data)
    if len(mac_hex) != 64 or meta_len + _SEAL_LEN - 1 > MAX_META_BYTES:
        raise ValueError("a seal is 64 hex digits, and the header must have room for it")
    meta_end = _FIXED.size + meta_len
    if data[meta_end - 1 : meta_end] != b"}":
        raise CorruptHeaderError("header metadata is not a JSON object")
    meta = data[_FIXED.size : meta_end - 1] + _SEAL_HEAD + mac_hex.encode() + b'"}'
    body = b"".join((_FIXED.pack(magic, version, reserved, len(meta), n_tokens), meta, data[meta_end:-_DIGEST]))
    return body + blake3.blake3(body).digest()


def unsealed(data: bytes) -> tuple[bytes, str] | None:
    """(the header's bytes before sealing, less the digest; its seal) if ``data``
    ends its JSON object with a ``fleet_mac`` member, else None. Checks the
    framing only: the caller has verified the digest (``decode_header``)."""
    magic, version, reserved, meta_len, n_tokens = _FIXED.unpack_from(data)
    meta_end = _FIXED.size + meta_len
    if meta_len < _SEAL_LEN + 1 or len(data) != meta_end + 4 * n_tokens + _DIGEST:
        return None
    tail = data[meta_end - _SEAL_LEN : meta_end]
    mac = tail[len(_SEAL_HEAD) : len(_SEAL_HEAD) + 64]
    if not tail.startswith(_SEAL_HEAD) or tail[-2:] != b'"}' or not all(c in b"0123456789abcdef" for c in mac):
        return None
    meta = data[_FIXED.size : meta_end - _SEAL_LEN] + b"}"
    fixed = _FIXED.pack(magic, version, reserved, len(meta), n_tokens)
    return fixed + meta + data[meta_end:-_DIGEST], mac.decode()
