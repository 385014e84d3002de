"""What proves a copy of a block good or bad (docs/scale-out.md, "Proof").

A block's name is the blake3 of its content, keyed with its namespace's key
under ``isolate_namespaces``; the name does not say which key. So a copy is
judged under every key a reader has reason to try, and a verdict says which
one it verified under:

- ``GOOD``: it hashes to its name under one of them. Any header that claims
  another key, or another size, for it is what is wrong (it convicts only
  itself);
- ``BROKEN``: its frame does not decode (bad magic, sizes that do not add up,
  zstd that does not inflate): bad under any key, proof on its own;
- ``UNNAMED``: it decodes but hashes to its name under none of the keys
  tried. Proof only when the key it was named with is known for sure: a
  header sealed with the fleet key names it (its writer computed the name),
  or (``check --remote``) every header in the bucket was read and the copy is
  older than any store in flight. Otherwise a lying header and a rotten block
  look the same, and nothing is deleted.

Every upload goes through ``verified_frame``: the bytes sent are the bytes
verified, in the same pass.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blockkv.errors import CorruptBlockError
from blockkv.format.frame import decode_block, frame_name, frame_raw_bytes, max_frame_bytes
from blockkv.fs import Buffer


class Judgement(enum.Enum):
    GOOD = "good"
    BROKEN = "broken"  # the frame does not decode: bad under any key
    UNNAMED = "unnamed"  # decodes, but is not its name under any key tried


@dataclass(frozen=True)
class Verdict:
    judgement: Judgement
    key: bytes | None = None  # the key it verified under (GOOD)
    raw_bytes: int = 0  # the payload length its frame declares (GOOD, UNNAMED)

    @property
    def good(self) -> bool:
        return self.judgement is Judgement.GOOD


def judge_block(name: str, data: bytes | memoryview, keys: Iterable[bytes | None]) -> Verdict:
    """A copy of block ``name`` judged under each of ``keys`` in turn (each once)."""
    try:
        payload = decode_block(name, data, verify=False)
    except CorruptBlockError:
        return Verdict(Judgement.BROKEN)
    raw = frame_raw_bytes(data)
    for key in dict.fromkeys(keys):
        if frame_name(data, payload, key) == name:
            return Verdict(Judgement.GOOD, key, raw)
    return Verdict(Judgement.UNNAMED, None, raw)


def convicts(verdict: Verdict, vouched: bool) -> bool:
    """Is ``verdict`` proof that the copy is bad? ``vouched``: the key it was
    named with is known for sure (see the module docstring)."""
    return verdict.judgement is Judgement.BROKEN or (verdict.judgement is Judgement.UNNAMED and vouched)


def verified_frame(name: str, frame: bytes | Sequence[Buffer], key: bytes | None) -> bytes:
    """``frame`` as the bytes to send, verified against ``name`` under ``key``
    (CorruptBlockError if they are not the block): what an upload sends is
    exactly what was verified."""
    data = frame if isinstance(frame, bytes) else b"".join(frame)
    decode_block(name, data, key=key)
    return data


def frame_limit(raw_bytes: int) -> int:
    """The most bytes a copy of a block with ``raw_bytes`` of payload may have:
    the read limit for it (``frame.max_frame_bytes``)."""
    return max_frame_bytes(raw_bytes)
