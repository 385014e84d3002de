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
verified, in the same pass. The judging itself (``judge_block``) is
``format/frame.py``'s, shared with the local store's checks.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockkv.format.frame import Judgement, Verdict, decode_block, max_frame_bytes
from blockkv.fs import Buffer


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

