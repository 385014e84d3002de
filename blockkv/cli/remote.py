"""``--remote s3://BUCKET/PREFIX``: how a command reaches the bucket a fleet
shares instead of a local root. The ``--remote-option`` settings, the bucket's
fingerprint directories chosen as a root's are, and a ``Bucket`` handle on one.

Each command's bucket variant lives with the command, whose output it shares;
this is what they have in common. The bucket modules (and the s3 extra) are
imported only once a command runs with ``--remote``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from blockkv.cli.common import UsageError, choose_fingerprints


def remote_options(args: argparse.Namespace) -> Any:
    """``--remote-option KEY=VALUE`` pairs, the ``remote_options`` a node runs
    with, split (``remote.options.RemoteOptions``: endpoint and credentials
    over the AWS environment variables, the bucket protocol's settings such as
    ``grace`` and ``timeout``, the fleet key over ``BLOCKKV_FLEET_KEY``)."""
    from blockkv.remote.options import split_options

    try:
        return split_options(dict(args.remote_option or ()))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def remote_fingerprints(
    args: argparse.Namespace, *, mutating: str | None, unreadable: list[str] | None = None
) -> list[Any]:
    """The bucket's fingerprint directories the command works on (``BucketFingerprint``s),
    chosen as for a root; directories whose IDENTITY does not read go to ``unreadable``."""
    if args.root is not None:
        raise UsageError(f"give a cache root or --remote, not both (got {args.root!r} and {args.remote!r})")
    if getattr(args, "grace", None) is not None:
        raise UsageError("with --remote the grace period is the fleet's: pass the nodes' own "
                         "--remote-option grace=SECONDS (default 3600), never a shorter one")
    if mutating and not (args.fingerprint or args.all):
        raise UsageError(
            f"{mutating} --remote changes the bucket for every node: name a fingerprint with "
            "-f/--fingerprint or pass --all"
        )
    try:
        from blockkv.bucket.bucket_reader import list_bucket_fingerprints
    except ImportError as exc:
        raise UsageError(f"--remote needs the s3 extra: {exc}") from None
    opts = remote_options(args)
    try:
        known, bad = list_bucket_fingerprints(args.remote, opts.s3, key=opts.key, **{
            k: v for k, v in opts.settings.items() if k in ("timeout", "connect_timeout", "max_retries")})
    except ValueError as exc:  # not an s3:// URL, an unknown option
        raise UsageError(str(exc)) from None
    if unreadable is not None:
        unreadable.extend(bad)
    if not known and not bad:  # an empty answer alone looks like an empty fleet, not a typo in the prefix
        print(f"blockkv: no blockkv store under {args.remote}: is that the --remote the nodes were given "
              "(s3://BUCKET/PREFIX, the prefix included)?", file=sys.stderr)
    return choose_fingerprints(known, args.fingerprint, args.remote)


@contextmanager
def open_bucket(args: argparse.Namespace, fp: Any) -> Iterator[Any]:
    """The fingerprint directory ``fp`` in the bucket as a ``Bucket`` handle with
    the command's ``--remote-option`` settings: for ``gc`` and ``evict`` they must
    be the fleet's own (``grace``, ``sweep_window``, ``timeout``, ``max_retries``),
    as the nodes run with them."""
    from blockkv.bucket.bucket import Bucket

    opts = remote_options(args)
    try:
        bucket = Bucket(args.remote, fp.name, opts.s3, key=opts.key, **opts.settings)
    except ValueError as exc:  # a grace too short for the timeout
        raise UsageError(str(exc)) from None
    try:
        yield bucket
    finally:
        bucket.close()
