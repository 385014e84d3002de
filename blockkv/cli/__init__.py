"""The ``blockkv`` console script: see what a cache root holds, verify and repair
it, and shrink it, with the habits of git (``count-objects``, ``fsck``, ``gc``)
and restic (``stats``, ``check``, ``prune``).

Safety rules, because this tool deletes on other people's disks:

* a root without the ``.blockkv`` marker is refused, never cleaned;
* a command that changes a store names its fingerprint (``-f``) or says ``--all``;
* ``ls``, ``stats`` and ``check`` without ``--repair`` only look
  (``local/reader.py``, ``local/directory_check.py``): they never write, rename, delete or
  lock, even on a damaged directory; ``evict --dry-run`` opens no store and
  changes nothing either.
* with ``--remote s3://bucket/prefix`` the same commands work on the bucket a
  fleet shares (``bucket/bucket_reader.py``): ``ls``, ``stats``, ``check`` only list and
  GET; ``gc`` is the bucket's mark-and-sweep run and ``evict`` its fleet-wide
  LRU, which every node's stores are safe beside (docs/scale-out.md).

Exit codes: 0 clean / done, 1 problems found (or the operation failed), 2 usage
error (bad arguments, missing or foreign root, unknown fingerprint).

This module is the parser and ``main``; a module per command family does the
work: ``reads`` (``stats``, ``ls``), ``check``, ``maintenance`` (``gc``,
``rebuild-index``, ``evict``), ``remove`` (``rm``), ``prompt_files`` (``export``,
``import``, ``warm``: mlx-lm prompt-cache files and system prompts, importing
mlx-lm only when they run) and ``passthrough`` (``demo``, ``serve``, ``route``,
``bench``), over what they share: ``common`` (exit codes, output, choosing
fingerprints), ``remote`` (reaching a bucket) and ``stores`` (opening a local
store, the one module that imports ``blockkv.store``).

**Starting is cheap, and stays so.** Scripts and cron loops call ``ls`` and
``stats`` often; importing mlx-lm (and transformers with it) costs ~1 s, a
store ~0.1 s. So:

* a command is registered here by name (``_run("reads", "cmd_ls")``) and its
  module imported only when it runs, so ``--help`` loads argparse and little
  else; a module that declares its own arguments (``remove``, ``prompt_files``:
  ``add_command(s)``) is imported to build the parser, so at module level it
  imports only what that needs (``common``, ``human``);
* a command module imports, at module level, only what every path of it
  needs; the rest (``blockkv.store`` through ``stores``, ``local.directory``,
  obstore through ``remote``, tqdm, a serving module) inside the function
  that uses it;
* nothing under ``cli/`` imports mlx-lm or ``blockkv.mlx_lm.prompt_cache``
  at module level (``format/kinds.py`` decodes through mlx-lm only when a
  cache is rebuilt; ``import blockkv`` loads its public names on first use).

``tests/cli/test_cli.py`` checks in a subprocess that ``--help``, ``ls`` and
``stats`` import neither mlx-lm nor transformers.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import lmdb

from blockkv.cli.common import EXIT_BROKEN_PIPE, EXIT_BUSY, EXIT_PROBLEMS, EXIT_USAGE, UsageError
from blockkv.cli.passthrough import PASSTHROUGH, run_passthrough
from blockkv.cli.prompt_files import add_commands as add_prompt_file_commands
from blockkv.cli.remove import add_command as add_rm_command
from blockkv.errors import BlockKVError, LockTimeout
from blockkv.human import parse_option, parse_seconds, parse_size, parse_wait


def _run(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A command's function, its module (``blockkv.cli.<module>``) imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(f"blockkv.cli.{module}"), function)(args))

    return run


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2), not a usage dump."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Let "--to -5G" reach parse_size (and its clear "negative" error) instead of
        # being read as an unknown option. No option of ours looks like a number.
        self._negative_number_matcher = re.compile(r"^-\d*\.?\d+[kmgtp]?(i?b)?$", re.I)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Version(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata costs ~15 ms of every start)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        from importlib.metadata import version

        print(f"blockkv {version('blockkv')}")
        parser.exit()


def _root_command(sub: Any, name: str, run: Callable[[argparse.Namespace], int], help: str, *, mutating: bool,
                  remote: bool = True) -> Parser:
    """A command over a cache root (or, ``remote``, a bucket instead) and its fingerprints."""
    p: Parser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(run=run, parser=p, mutating=mutating, remote=None)
    if remote:
        p.add_argument("root", nargs="?", help="cache root (the directory holding .blockkv; "
                       "default: serve's, ~/.cache/blockkv); or --remote instead")
        p.add_argument("--remote", metavar="s3://BUCKET/PREFIX",
                       help="the bucket a fleet of nodes shares instead of a local root (endpoint and "
                       "credentials: the AWS_* environment variables or --remote-option)")
        p.add_argument("--remote-option", action="append", type=parse_option, metavar="KEY=VALUE",
                       help="what the nodes pass as remote_options (repeatable): endpoint_url, "
                       "access_key_id, secret_access_key, session_token, region (over the AWS_* "
                       "variables) and the bucket settings grace, sweep_window, timeout, max_retries...")
    else:
        p.add_argument("root", nargs="?", help="cache root (the directory holding .blockkv; "
                       "default: serve's, ~/.cache/blockkv)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "-f", "--fingerprint", action="append", metavar="FP",
        help="config fingerprint, fingerprint directory, or a unique prefix (repeatable)"
        + ("" if mutating else "; default: all"),
    )
    which.add_argument("--all", action="store_true", help="every fingerprint in the root")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _plain_command(sub: Any, name: str, run: Callable[[argparse.Namespace], int], help: str) -> Parser:
    """A command that parses its own positionals (``rm``, ``export``, ``import``, ``warm``)."""
    p: Parser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(run=run, parser=p, mutating=True, remote=None)
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def build_parser() -> Parser:
    parser = Parser(
        prog="blockkv",
        description="Inspect, verify, repair and shrink a blockkv cache root.",
        epilog="exit codes: 0 clean/done, 1 problems found or failure, 2 usage error",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = functools.partial(_root_command, sub)
    stats = command("stats", _run("reads", "cmd_stats"),
                    "per model and namespace: entries, bytes, dedup, blocks, use", mutating=False)
    stats.add_argument("--cap", type=parse_size, metavar="BYTES",
                       help="the byte cap your server runs with, to show use against it")
    ls = command("ls", _run("reads", "cmd_ls"), "list entries, least recently used first", mutating=False)
    ls.add_argument("-n", "--namespace", action="append", metavar="NS",
                    help="only this namespace (repeatable; '' is the default namespace)")
    check = command("check", _run("check", "cmd_check"),
                    "verify headers, refcounts and every block hash; --repair fixes",
                    mutating=False)
    check.add_argument("--repair", action="store_true",
                       help="fix refcounts, remove dangling entries and unreferenced blocks "
                       "(needs -f or --all)")
    check.add_argument("--wait", type=parse_wait, default=30.0, metavar="SECONDS",
                       help="the longest each wait for a lock lasts (a store in progress, --repair's open; "
                       "default: 30); a writer stopped in the middle of one is reported as busy, exit 75")
    check.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: when stderr is a terminal)")
    gc_cmd = command("gc", _run("maintenance", "cmd_gc"), "delete blocks no entry references", mutating=True)
    gc_cmd.add_argument("--grace", type=parse_seconds, metavar="SECONDS",
                        help="only blocks unreferenced for this long (default: the store's, "
                        "which protects a writer in another process; not with --remote: there the "
                        "fleet's --remote-option grace=SECONDS applies)")
    command("rebuild-index", _run("maintenance", "cmd_rebuild_index"), "rebuild the LMDB index from the files on disk",
            mutating=True, remote=False)
    evict = command("evict", _run("maintenance", "cmd_evict"),
                    "remove least recently used entries until a fingerprint fits in --to bytes",
                    mutating=True)
    evict.add_argument("--to", type=parse_size, required=True, metavar="BYTES",
                       help="target bytes on disk (with --remote: in the bucket) per fingerprint: "
                       "4096, 500M, 10G (binary units)")
    evict.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")

    plain = functools.partial(_plain_command, sub)
    add_rm_command(plain)
    add_prompt_file_commands(sub, plain)
    for name, help in PASSTHROUGH.items():
        sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in PASSTHROUGH:
        return run_passthrough(args_list[0], args_list[1:])
    args, unknown = build_parser().parse_known_args(args_list)
    if unknown and getattr(args, "trailing", None) and not any(u.startswith("-") for u in unknown):
        getattr(args, args.trailing).extend(unknown)  # positionals after the options (argparse stops at them)
        unknown = []
    if unknown:  # reported by the subcommand's parser: "blockkv stats: error: ..."
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    prog = f"blockkv {args.command}"
    if hasattr(signal, "SIGPIPE") and not (args.mutating or getattr(args, "repair", False)):
        # `blockkv ls | head -1`: when the reader leaves, a command that only looks
        # ends quietly as ls and git do (killed by SIGPIPE), never with exit 1,
        # "problems found". Not serve (its sockets must not die with their
        # clients), and not a command that changes a store: it finishes its work
        # and then exits 141 below, as a shell would report SIGPIPE.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # a command that changes a store, or no SIGPIPE on this platform
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except LockTimeout as exc:  # a writer stopped (or slow) in the middle of a store: never waited on without bound
        print(f"{prog}: busy: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except (BlockKVError, OSError, ValueError, lmdb.Error) as exc:
        # what the disk or the store refused, in one line: a script gets exit 1
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        return 130
