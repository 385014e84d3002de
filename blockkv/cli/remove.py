"""``rm``: remove entries by id, or every entry of a namespace, from one
fingerprint. Their blocks stay until ``gc`` (the store's grace protects a
writer in another process about to share one), as after ``evict``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blockkv.cli.common import (
    EXIT_OK,
    UsageError,
    check_root,
    emit_json,
    entry_json,
    fp_json,
    gc_hint,
    label,
    one_entry,
    select_fingerprints,
    show_ns,
)
from blockkv.human import format_size, format_time, render_table


def add_command(make: Any) -> None:
    rm = make("rm", cmd_rm, "remove entries (by id, or every entry of a namespace) from one fingerprint")
    rm.add_argument("root", nargs="?", help="cache root (default: serve's, ~/.cache/blockkv)")
    rm.add_argument("entries", nargs="*", metavar="ENTRY", help="entry ids (or unique prefixes), as 'ls' shows")
    rm.add_argument("-f", "--fingerprint", required=True, metavar="FP", help="the fingerprint they are in")
    rm.add_argument("-n", "--namespace", action="append", metavar="NS",
                    help="every entry of this namespace (repeatable; '' is the default namespace)")
    rm.set_defaults(trailing="entries")  # 'rm ROOT -f FP ID...': ids after the options are entries too


def cmd_rm(args: argparse.Namespace) -> int:
    from blockkv.cli.stores import open_store
    from blockkv.local.directory import disk_usage
    from blockkv.local.reader import read_directory

    root, wanted = _root_and_entries(args)
    if not wanted and not args.namespace:
        raise UsageError("name entries (ENTRY...) or a namespace (-n NS) to remove")
    (fp,) = select_fingerprints(root, [args.fingerprint], False, mutating="rm")
    entries = read_directory(fp.path).entries  # of either mode, a per-key server's too: the store serves one
    doomed = [e for e in entries if args.namespace and e.ns in args.namespace]
    for want in wanted:
        entry = one_entry(entries, want, fp.path.name)
        doomed += [entry] if entry not in doomed else []
    with open_store(fp) as store:
        blocks_before = store.block_count
        for entry in doomed:
            store.remove(entry)
        released, grace = blocks_before - store.block_count, store.gc_grace
    disk = disk_usage(fp.path).total
    out = {**fp_json(fp), "entries": [entry_json(e) for e in doomed], "blocks_released": released,
           "gc_grace": grace, "disk_bytes": disk}
    if args.json:
        emit_json({"root": str(root), **out})
        return EXIT_OK
    print(f"{label(out)}: removed {len(doomed)} entries; {format_size(disk)} still on disk in this fingerprint")
    if doomed:
        print(render_table(["  NAMESPACE", "ENTRY", "TOKENS", "BYTES", "LAST USE"],
                           [["  " + show_ns(e.ns), e.id, str(e.length), format_size(e.nbytes),
                             format_time(e.last_use)] for e in doomed], right={2, 3}))
    if released:
        print(gc_hint(out["fingerprint"], released, grace))
    return EXIT_OK


def _root_and_entries(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """argparse gives the first positional to ROOT: it is an entry when it is no directory."""
    if args.root is not None and not Path(args.root).expanduser().is_dir():
        return check_root(None), [args.root, *args.entries]
    return check_root(args.root), list(args.entries)
