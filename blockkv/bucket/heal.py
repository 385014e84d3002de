"""What a node does about a copy of a block proven bad (docs/scale-out.md,
"Proof, and healing"): one bad copy must never take good data with it.

- a bad bucket copy and a verified local one: the local bytes replace it,
  conditionally (``If-Match`` on the bad copy's ETag, so nothing else is
  ever overwritten);
- a bad bucket copy and no good one in sight: it is deleted inside a
  deleter's window (gc.py's ``Window``: a writer whose store overlaps it
  waits and uploads its own verified copy again), and a ``wanted/<block>``
  mark asks the fleet for a good copy; every node's sync answers the marks
  it holds a verified copy for (``answer_wanted``);
- a bad local copy and a verified bucket copy: the tier writes the bucket's
  bytes over it (tier.py, ``heal_block``).

fetch.py calls the first two on what a fetch proves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from blockkv.bucket.bucket_dir import BucketDir
from blockkv.bucket.gc import Window
from blockkv.bucket.objects import BucketError, outage
from blockkv.errors import BlockMissingError

MAX_WANTED = 256  # marks a node answers per sync: planted ones cost a local lookup each, no more


def replace_bad_copy(bucket: BucketDir, name: str, bad_etag: str, good: bytes) -> bool:
    """Put verified ``good`` bytes in place of the copy with ``bad_etag``, only
    if that copy is still there; True if this call replaced it."""
    with outage(f"replacing block {name}"):
        return bool(bad_etag) and bucket.blocks.put_if_match(name, [good], bad_etag)


def quarantine(bucket: BucketDir, bad: Mapping[str, str]) -> list[str]:
    """Delete the copies ``bad`` names (block -> the ETag of the copy proven
    bad) that are still those copies, inside a deleter's window, then ask the
    fleet for good copies of them. Returns the names deleted."""
    if not bad:
        return []
    window = Window(bucket)
    try:
        still = []
        for name, etag in bad.items():
            try:
                with outage("quarantine"):
                    if bucket.blocks.info(name).etag == etag:  # not replaced by a good copy since
                        still.append(name)
            except BlockMissingError:
                continue
        deleted = window.delete(still)
    finally:
        window.close()
    for name in deleted:
        want(bucket, name)
    return deleted


def want(bucket: BucketDir, name: str) -> None:
    """Ask the fleet for a good copy of block ``name`` (``wanted/<name>``)."""
    try:
        with outage("wanted mark"):
            bucket.meta.put_if_absent(f"wanted/{name}", [b""])
    except BucketError:
        pass  # the next reader that meets the gap asks again


def wanted_blocks(bucket: BucketDir) -> dict[str, float]:
    """Blocks the fleet asked a good copy of -> when first asked (server time)."""
    with outage("wanted listing"):
        return {i.name.removeprefix("wanted/"): i.last_modified for i in bucket.meta.list_info("wanted/")}


def answer_wanted(bucket: BucketDir, local: Callable[[str], bytes | None], limit: int = MAX_WANTED) -> list[str]:
    """Upload a verified local copy of each wanted block this node holds
    (``local(name)``: verified bytes, or None), with a conditional create,
    and clear the marks of blocks the bucket holds again. Returns the blocks
    this node uploaded."""
    sent = []
    for name in sorted(wanted_blocks(bucket))[:limit]:
        data = local(name)
        if data is None:
            continue
        with outage(f"upload of wanted block {name}"):
            if bucket.blocks.put_if_absent(name, [data]):
                sent.append(name)
            bucket.meta.delete(f"wanted/{name}")
    return sent
