"""What every ``blockkv`` command shares: the exit codes and the usage error,
JSON output, and choosing what a command works on (a checked root and its
fingerprints, or a bucket's) and naming a fingerprint the same way in every
output, so scripts can join them.

Nothing here opens a store (``blockkv.cli.stores`` does): ``ls`` and ``stats``
need only this and the read-only views.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: ``--help`` loads none of them (cli/__init__.py)
    from blockkv.local.directory import FingerprintDir
    from blockkv.records import Entry

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_BUSY = 75  # sysexits' EX_TEMPFAIL: a writer holds the root now; try again
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process killed by SIGPIPE


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit 2."""


# -- output ----------------------------------------------------------------------


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def show_ns(ns: str) -> str:
    """Namespaces are arbitrary strings (the default is empty): quote them."""
    return json.dumps(ns)


def where_key(args: argparse.Namespace) -> str:
    """The JSON key naming what a command looked at."""
    return "remote" if args.remote else "root"


# -- root and fingerprint selection -------------------------------------------


def check_root(text: str | None) -> Path:
    """The root as a Path (default: serve's, ``default_root``), or a UsageError
    if it is missing or not a blockkv root."""
    from blockkv.local.directory import ROOT_MARKER, default_root

    path = Path(text).expanduser() if text is not None else default_root()
    text = str(path) if text is None else text
    if not path.exists():
        raise UsageError(f"{text}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{text}: not a directory")
    if not (path / ROOT_MARKER).exists():
        raise UsageError(
            f"{text}: not a blockkv root (no {ROOT_MARKER} marker); refusing to touch it"
        )
    return path


def select_fingerprints(
    root: Path, wanted: Sequence[str] | None, everything: bool, *, mutating: str | None
) -> list[FingerprintDir]:
    """The fingerprints a command works on: those named (exact model id, config
    fingerprint or directory name, or a unique prefix of one), else all. A
    ``mutating`` command must name them or say ``--all`` so it never touches
    another model by default."""
    from blockkv.local.directory import list_fingerprints

    if mutating and not (wanted or everything):
        raise UsageError(
            f"{mutating} changes the store: name a fingerprint with -f/--fingerprint or pass --all"
        )
    return choose_fingerprints(list_fingerprints(root), wanted, str(root))


def choose_fingerprints(known: list[Any], wanted: Sequence[str] | None, where: str) -> list[Any]:
    """Of the fingerprints ``known`` in ``where`` (local directories or a
    bucket's), those ``wanted`` names (all if none)."""
    if not wanted:
        return known
    chosen: list[Any] = []
    for want in wanted:
        if not want:
            raise UsageError("an empty fingerprint (an unset shell variable?) names none")
        keys = [(fp, (fp.model_id, fp.config_fingerprint, fp_place(fp)[0])) for fp in known]
        matches = [fp for fp, names in keys if want in names] or [
            fp for fp, names in keys if any(n.startswith(want) for n in names)
        ]
        if not matches:
            have = ", ".join(fp_place(fp)[0] for fp in known) or "none"
            raise UsageError(f"no fingerprint {want!r} in {where} (have: {have})")
        if len(matches) > 1:
            have = ", ".join(label(fp_json(fp)) for fp in matches)
            raise UsageError(f"fingerprint {want!r} is ambiguous (matches: {have})")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def fp_place(fp: Any) -> tuple[str, str]:
    """(directory name, where it is) of a local ``FingerprintDir`` (its path) or
    a ``BucketFingerprint`` (its s3:// URL)."""
    url = getattr(fp, "url", None)
    return (fp.name, url) if url is not None else (fp.path.name, str(fp.path))


def fp_json(fp: Any) -> dict[str, Any]:
    """How every JSON output names a fingerprint (local or in a bucket), so scripts can join them."""
    from blockkv.mlx_lm.identity import describe_fingerprint

    words = describe_fingerprint(fp.config_fingerprint)
    name, where = fp_place(fp)
    return {
        "fingerprint": name,
        "config_fingerprint": fp.config_fingerprint,
        "model_id": fp.model_id,
        "tokenizer_hash": fp.tokenizer_hash,
        # what blockkv serve / PersistentPromptCache wrote into the fingerprint; None for other stores
        "kv_quantisation": words.kv if words else None,
        "chat_template": words.template if words else None,
        "dir": where,
    }


def entry_json(e: Entry) -> dict[str, Any]:
    """One entry for ``ls`` and ``evict``: token count, not the tokens themselves."""
    return {
        "id": e.id,
        "ns": e.ns,
        "tokens": e.length,
        "nbytes": e.nbytes,
        "blocks": len(e.blocks),
        "last_use": e.last_use,
        "trimmable": e.trimmable,
        "minimum_reusable_offset": e.minimum_reusable_offset,
        "checkpoint": e.checkpoint.to_json() if e.checkpoint is not None else None,
        "attachments": list(e.attachments),
    }


def one_entry(entries: Sequence[Entry], wanted: str, where: str) -> Entry:
    """The entry ``wanted`` names: its id, or a prefix of exactly one id (as ``ls`` shows them)."""
    if not wanted:
        raise UsageError("an empty entry id (an unset shell variable?) names no entry")
    hits = [e for e in entries if e.id == wanted] or [e for e in entries if e.id.startswith(wanted)]
    if len(hits) != 1:
        raise UsageError(f"{'no' if not hits else 'more than one'} entry {wanted!r} in {where}")
    return hits[0]


def gc_hint(fingerprint: str, blocks: int, grace: float) -> str:
    """What to run for blocks a command left unreferenced (a command that works as shown)."""
    return (f"  {blocks} block(s) no longer referenced: 'blockkv gc -f {fingerprint}' deletes them "
            f"once unreferenced for {grace:g} s (--grace 0: now)")


def label(fp: dict[str, Any]) -> str:
    """How a fingerprint is named in human output (from its ``fp_json``)."""
    words = [fp["model_id"]]
    if fp["kv_quantisation"] is not None:
        words += [f"kv {fp['kv_quantisation']}", f"template {fp['chat_template']}"]
    return f"{fp['fingerprint']} ({', '.join(words)})"
