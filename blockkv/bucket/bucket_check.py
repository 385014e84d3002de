"""``check --remote``: verify a fingerprint directory in a bucket, and with
``--repair`` act on what is proven, and on nothing else (docs/scale-out.md,
"Proof, and healing").

Every header is read (bounded, verified; with a fleet key only sealed ones
count). Every block a header names is read with the most a frame of the
size its headers declare can be, and judged under the key of every header
that names it (verify.py): a block that is its name under one key is good,
and a header that names it with another key or size is a bad header, which
convicts only itself. A block is proven bad only by a frame that does not
decode, or by hashing to its name under no key when that key is known for
sure: a sealed header names it, or (no fleet key) every header in the
directory was read and the block is older than the grace period, so no
store in flight can be the one that named it. Anything else is a suspect:
reported, never deleted. Blocks no header names are stores in flight or
garbage for ``gc``: listed, not read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from blockkv.bucket import heal
from blockkv.bucket.bucket_dir import BucketDir
from blockkv.bucket.bucket_reader import Listed, list_directory
from blockkv.bucket.bucket_verdicts import convicts, frame_limit
from blockkv.bucket.clock import CLOCK_SLACK
from blockkv.bucket.objects import BucketError, outage
from blockkv.errors import BlockMissingError, OversizedError
from blockkv.format.blocks import block_naming_key, modes
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import judge_block
from blockkv.format.header import Identity
from blockkv.records import CheckReport


@dataclass
class BucketCheckReport(CheckReport):
    """``CheckReport`` plus what only a bucket has."""

    bad_headers: list[str] = field(default_factory=list)  # name a good block with another key or size
    unsealed_headers: list[str] = field(default_factory=list)  # fleet key set, no valid seal: never served
    suspect_blocks: list[str] = field(default_factory=list)  # do not verify, without proof they are bad
    waiting_for_copy: list[str] = field(default_factory=list)  # blocks asked of the fleet (wanted/), not yet back

    @property
    def clean(self) -> bool:
        return super().clean and not (self.bad_headers or self.unsealed_headers or self.suspect_blocks)


@dataclass(frozen=True)
class _Claim:
    """One header's claim about a block it names."""

    header: str
    key: bytes | None
    raw_bytes: int
    sealed: bool


def check_bucket(bucket: BucketDir, identity: Identity, progress: Callable[[int, int], None] | None = None, *,
                 repair: bool = False) -> BucketCheckReport:
    """Verify a fingerprint directory in a bucket (see the module docstring).
    A transient failure on one block is ``unreadable``. Without ``repair``
    nothing is written; with it, what is proven goes (``_repair``) and
    ``actions`` says what."""
    listed = list_directory(bucket)
    own = {mode.digest() for mode in modes(identity)}  # a --per-key-cache node's entries are ours too
    report = BucketCheckReport(unsealed_headers=listed.unsealed,
                               newer_headers=listed.sealed_damaged)
    claims: dict[str, list[_Claim]] = {}
    for name, read in sorted(listed.records.items()):
        if read is None:
            if name not in listed.sealed_damaged:
                report.corrupt_headers.append(name)
            continue
        record, copy = read
        if record.owner not in own:
            report.foreign_headers.append(name)
        else:
            report.entries += 1
        key = block_naming_key(copy.header.identity, copy.header.ns)
        for ref in blocks_for_prefix(copy.header.descriptor, None):
            claims.setdefault(ref.name, []).append(_Claim(name, key, ref.raw_bytes, copy.sealed))
    # no key known for sure without a seal unless every header was read and the block is old
    # the server's time, at least (a repair asks its clock; a check only reads, so it takes the newest object)
    now = max((i.last_modified for i in [*listed.blocks.values(), *listed.headers.values()]), default=0.0)
    if repair:
        now = max(now, bucket.server_now())
    settled = now - bucket.grace - CLOCK_SLACK if not any(r is None for r in listed.records.values()) else None
    bad: dict[str, str] = {}  # block -> ETag of the copy proven bad
    names = sorted(n for n in listed.blocks if n in claims)
    for done, name in enumerate(names, 1):
        _judge(bucket, name, claims[name], settled, report, bad)
        if progress is not None:
            progress(done, len(names))
    report.corrupt_blocks = sorted(bad)
    gone = set(bad) | {b for b in claims if b not in listed.blocks}
    convicted = set(report.bad_headers)
    report.dangling = sorted(
        r.id for n, read in listed.records.items() if read is not None and n not in convicted
        for r in [read[0]] if r.owner in own and any(b in gone for b in r.blocks))
    report.in_flight = sorted(n for n in listed.blocks if n not in claims)
    if repair:
        report.actions = _repair(bucket, report, listed, bad, gone)
    return report


def _judge(bucket: BucketDir, name: str, claims: list[_Claim], settled: float | None,
           report: BucketCheckReport, bad: dict[str, str]) -> None:
    """One referenced block: read (bounded by its headers' sizes) and judged."""
    vouched = any(c.sealed for c in claims)
    try:
        with outage(f"fetch of block {name}"):
            data, meta = bucket.blocks.get_limited(name, max(frame_limit(c.raw_bytes) for c in claims))
    except OversizedError as exc:  # larger than every header naming it allows
        if vouched:
            bad[name] = exc.etag  # the copy read, not the one listed: it may have been replaced since
        else:
            report.suspect_blocks.append(name)
        return
    except BlockMissingError:
        return  # deleted by a gc since the listing
    except BucketError:
        report.unreadable.append(name)
        return
    report.blocks += 1  # what was read and judged: blocks no header names are listed apart, never read
    verdict = judge_block(name, data, [*(c.key for c in claims), None])
    if verdict.good:
        report.bad_headers += [c.header for c in claims
                               if (c.key != verdict.key or c.raw_bytes != verdict.raw_bytes)
                               and c.header not in report.bad_headers]
    elif convicts(verdict, vouched or (settled is not None and meta["last_modified"].timestamp() < settled)):
        bad[name] = (meta.get("e_tag") or "").strip('"')
    else:
        report.suspect_blocks.append(name)


def _repair(bucket: BucketDir, report: BucketCheckReport, listed: Listed, bad: dict[str, str],
            gone: set[str]) -> list[str]:
    """Act on proof only: a bad header goes (it convicts itself; a good block
    stays), a proven-bad block is deleted inside a deleter's window with a
    request for a good copy (heal.py), and an entry missing a block is removed
    only once the fleet has had a grace period to send a good copy back (its
    ``wanted/`` mark is that old); until then the mark is made and the entry
    waits."""
    actions = []
    for name in heal.quarantine(bucket, bad):
        actions.append(f"deleted corrupt block {name} and asked the fleet for a good copy")
    for name in report.bad_headers:
        _remove_header(bucket, name)
        actions.append(f"removed header {name}: it names a good block with the wrong namespace key or size")
    wanted = heal.wanted_blocks(bucket)
    old_enough = bucket.server_now() - bucket.grace - CLOCK_SLACK
    waiting: set[str] = set()
    dangling = set(report.dangling)
    for name, read in sorted(listed.records.items()):
        if read is None or read[0].id not in dangling:
            continue
        missing = [b for b in read[0].blocks if b in gone]
        for block in missing:
            if block not in wanted:
                heal.want(bucket, block)
        if all(wanted.get(b, float("inf")) < old_enough for b in missing):
            try:
                with outage("repair"):
                    if all(bucket.blocks.exists(b) for b in missing):
                        continue  # a good copy came back meanwhile: servable again
            except BucketError:
                continue
            _remove_header(bucket, name)
            actions.append(f"removed entry {read[0].id} (header {name}): a block it needs has been missing "
                           f"for a grace period and no node had a good copy")
        else:
            waiting.update(missing)
    report.waiting_for_copy = sorted(waiting)
    return actions


def _remove_header(bucket: BucketDir, name: str) -> None:
    try:
        with outage("repair"):
            bucket.headers.delete(name)
            bucket.meta.delete(f"used/{name}")
    except BucketError:
        pass
