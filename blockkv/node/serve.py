"""``blockkv serve``: mlx-lm's own OpenAI-compatible server, with a disk tier.

Nothing of mlx-lm's server is copied. Its ``main`` parses every one of its
flags as usual; blockkv only takes its own flags (``--cache-dir``,
``--cache-bytes``, ``--min-restore-tokens``, ``--remote``, ``--remote-option``,
``--fleet-salt``) off the command line first and, for the duration of the call,
replaces the names the server looks up when it starts (every one of them is
in ``hooks.py``) so the prompt cache it builds is a
``PersistentPromptCache`` configured with the server's own KV-quantisation and
chat-template flags; its HTTP server also answers ``GET /metrics``
(``metrics.py``), ``POST /blockkv/flush`` (``flush.py``), ``GET
/blockkv/health`` (the disk tier's state: ``health.py``) and, for ``blockkv
route``, what the server holds (``GET /blockkv/events``, ``GET
/blockkv/residency``: ``residency_endpoint.py``); with API keys every path but
``/health`` needs one (``auth.py``), and ``--per-key-cache`` gives each key a
cache of its own, within ``--key-share`` of the tiers, with its own
``/metrics`` counts (``--operator-key-file``'s keys read everyone's and the
residency) (``tenants.py``).
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from blockkv.human import format_size, parse_count, parse_option
from blockkv.local.directory import default_root, stored_bytes
from blockkv.mlx_lm.budget import FLOOR_BYTES, describe, parse_budget
from blockkv.mlx_lm.identity import KVQuant
from blockkv.mlx_lm.prompt_cache import DEFAULT_CACHE_BYTES, check_remote
from blockkv.node import hooks, tenants
from blockkv.node.flush import flush_handler
from blockkv.node.health import health_handler
from blockkv.node.journal import Journal
from blockkv.node.metrics import ServeMetrics, with_metrics_path
from blockkv.node.residency_endpoint import ResidentPromptCache, residency_handler
from blockkv.wire.auth import ApiKeys, add_key_options, keys_from, read_key_file, with_keys
from blockkv.wire.bounded_server import add_connection_options, bounded_server_class
from blockkv.wire.residency import SALT_ENV, digest_key
from blockkv.wire.shedding import shedding

log = logging.getLogger(__name__)

# how often serve looks whether mlx-lm has loaded a model given as a repo id (to open its store then)
LOAD_POLL_S = 0.2


class _OneLineParser(argparse.ArgumentParser):
    """A bad blockkv flag is one line on stderr and exit 2, before anything is created."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _own_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="blockkv serve",
        add_help=False,
        description="mlx-lm's server (every mlx_lm.server flag works) with blockkv as its disk tier.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_root(),
        help="cache root on local disk (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-bytes",
        type=parse_budget,
        default=None,
        help=f"cap of the disk tier per model: bytes (20G) or a share of the disk holding --cache-dir (10%%: of "
        f"what the tier holds plus the free space, read again at each store, at least "
        f"{format_size(FLOOR_BYTES)}) (default: {format_size(DEFAULT_CACHE_BYTES)})",
    )
    parser.add_argument(
        "--min-restore-tokens",
        type=parse_count,
        default=None,
        metavar="N",
        help="restore from disk only a match that saves at least N tokens of prefill "
        "(default: one block, 256)",
    )
    parser.add_argument(
        "--remote",
        metavar="s3://BUCKET/PREFIX",
        help="share the cache with every server on this bucket (--cache-dir stays the local tier); "
        "endpoint and credentials from the AWS_* environment variables or --remote-option",
    )
    parser.add_argument(
        "--remote-option",
        action="append",
        type=parse_option,
        metavar="KEY=VALUE",
        help="remote_options (repeatable): endpoint_url, access_key_id, secret_access_key, session_token, "
        "region, and the bucket settings grace, timeout, sync_interval... (docs/scale-out.md)",
    )
    parser.add_argument(
        "--fleet-salt",
        metavar="SECRET",
        help=f"salt of the prefix digests this server publishes for blockkv route; the same on every node "
        f"and the router (default: ${SALT_ENV}, else none)",
    )
    add_key_options(parser, "A blockkv route in front sends one of them (its --node-api-key-file).")
    add_connection_options(parser)
    parser.add_argument(
        "--per-key-cache",
        action="store_true",
        help="each API key reads and writes a prompt cache of its own (RAM and disk): no tenant learns from "
        "cached_tokens what another sent; requests of every key still run in one batch",
    )
    parser.add_argument(
        "--operator-key-file",
        type=Path,
        metavar="FILE",
        help="with --per-key-cache: the operator's API keys, one a line (also accepted as API keys): GET /metrics "
        "with one shows every key's counts, labelled by key id (any other key: its own counts only); only they "
        "read the residency, and a request sent with one may name its tenant (a 'blockkv route --per-key-cache' "
        "in front sends its node key, which must be one of them)",
    )
    parser.add_argument(
        "--key-share",
        type=tenants.parse_share,
        default=tenants.DEFAULT_KEY_SHARE,
        metavar="SHARE",
        help="with --per-key-cache: the most one key holds of the RAM tier's entries and of the disk cap, as a "
        "fraction or a percentage; past it a key's stores evict its own least recently used entries "
        f"(default: {tenants.DEFAULT_KEY_SHARE * 100:.0f}%%)",
    )
    return parser


def _loaded_models(model_provider: Any, key: Any) -> list[Any] | None:
    """The model objects mlx-lm's server makes caches for under ``key``
    (the model, then its draft model); None if another key is loaded."""
    if model_provider.model_key != key:
        return None
    return [m for m in (model_provider.model, model_provider.draft_model) if m is not None]


def check_model(rest: list[str]) -> None:
    """Refuse a ``--model`` that is not a directory but looks like a path (mlx-lm
    would ask Hugging Face for it, and answer ``/health`` 503 for ever behind the
    error) or is not a Hugging Face repo id either: mlx-lm loads it only after
    the server started, and would answer every request with 404 "generation
    thread died"."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    model = parser.parse_known_args(rest)[0].model
    if model is None or Path(model).expanduser().is_dir():
        return
    if _looks_local(model):
        raise FileNotFoundError(f"--model {model}: no such directory")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise FileNotFoundError(f"--model {model}: no such directory, and not a Hugging Face repo id") from None


def _looks_local(model: str) -> bool:
    """A path, not a repo id (``owner/name``): absolute, relative to ``.``/``~``,
    deeper than two parts, or under a directory that exists here (``models/nope``)."""
    path = Path(model)
    return (model.startswith((".", "~", os.sep)) or len(path.parts) > 2
            or (len(path.parts) == 2 and path.parent.is_dir()))


def check_port(host: str, port: int) -> None:
    """``OSError`` if mlx-lm's HTTP server could not listen on ``host:port`` (another
    process has it): found before mlx-lm starts its threads, which would keep the
    process alive behind the traceback."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server's own
        probe.bind(address)


def _writable(directory: Path) -> bool:
    """Whether this process may create files in ``directory`` (its permissions, and not a read-only mount)."""
    return os.access(directory, os.W_OK | os.X_OK) and not os.statvfs(directory).f_flag & os.ST_RDONLY


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _may_publish_residency(mlx_args: list[str], salt: str | None) -> bool:
    """Whether to answer ``GET /blockkv/residency`` and ``/blockkv/events``: not on an
    address other hosts reach unless the fleet has a salt, because without one the
    digests are of public tokens: anyone reaching the port would learn, for a prompt
    they guess, whether this node holds it, without sending it."""
    host = argparse.ArgumentParser(add_help=False)
    host.add_argument("--host", default="127.0.0.1")
    address = host.parse_known_args(mlx_args)[0].host
    if (salt if salt is not None else os.environ.get(SALT_ENV, "")) or _is_loopback(address):
        return True
    log.warning("blockkv serve: --host %s is reachable from other hosts and no --fleet-salt (or $%s) is set, "
                "so what this node holds is not published for blockkv route: set the same secret salt on every "
                "node and the router to publish it", address, SALT_ENV)
    return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    """Run ``mlx_lm.server.main`` with the persistent cache; returns its exit status."""
    import mlx_lm.server as server

    own = _own_parser()
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
        print("\nmlx_lm.server options:\n")
    try:
        keys, options, unreachable = _checked(args, rest)
        node = _Node(args, options, keys, publish=_may_publish_residency(rest, args.fleet_salt))
        undo = hooks.install(server, node.hooks())
    except (ValueError, TypeError, ImportError, FileNotFoundError, PermissionError) as e:
        own.exit(2, f"blockkv serve: error: {e}\n")
    if unreachable:
        log.warning("blockkv: %s; serving from the local cache until it answers", unreachable)
    # SIGTERM (systemd, docker stop) shuts down like Ctrl-C, so pending spills are flushed.
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    saved_argv = sys.argv
    sys.argv = ["blockkv serve", *rest]
    try:
        server.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        undo()
        sys.argv = saved_argv
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_term)
        node.close()
    return 0


def _checked(args: argparse.Namespace, rest: list[str]) -> tuple[ApiKeys, dict[str, str] | None, str | None]:
    """The flags' mistakes found before mlx-lm starts (``ValueError`` and kin):
    the keys (the operator's in ``args.operators``), the bucket's options, and
    why the bucket cannot be reached now (or None)."""
    options = dict(args.remote_option) if args.remote_option else None
    check_remote(args.remote, options)
    check_model(rest)
    if args.cache_dir.exists() and not args.cache_dir.is_dir():
        raise ValueError(f"--cache-dir {args.cache_dir} is a file, not a directory")
    if args.cache_dir.is_dir() and not _writable(args.cache_dir):
        raise ValueError(f"--cache-dir {args.cache_dir} is read-only: serve stores there, and would run "
                         "RAM-only; give it a writable directory (blockkv export reads a read-only root)")
    operators = read_key_file(args.operator_key_file, "--operator-key-file") if args.operator_key_file else []
    if operators and not args.per_key_cache:
        raise ValueError("--operator-key-file needs --per-key-cache (without it every key reads every metric)")
    args.operators = ApiKeys(operators)
    keys = keys_from(args, also=operators)
    if args.per_key_cache and not keys:
        raise ValueError("--per-key-cache needs API keys (--api-key, --api-key-file or $BLOCKKV_API_KEY)")
    # a missing bucket is a mistake to fix before serving (a typo in its name would otherwise
    # leave the fleet unshared); one the server cannot reach now is an outage, ridden out
    unreachable = None
    if args.remote is not None:
        from blockkv.remote.options import probe_bucket

        unreachable = probe_bucket(args.remote, options)
    return keys, options, unreachable


class _Node:
    """One ``blockkv serve`` process's disk tier: the caches mlx-lm's server
    builds, what they publish, and the handler that serves them."""

    def __init__(self, args: argparse.Namespace, options: dict[str, str] | None, keys: ApiKeys,
                 publish: bool) -> None:
        self.args, self.options, self.keys, self.publish = args, options, keys, publish
        self.cache_bytes = args.cache_bytes if args.cache_bytes is not None else DEFAULT_CACHE_BYTES
        self.caches: list[ResidentPromptCache] = []
        self.metrics = ServeMetrics(lambda: list(self.caches),
                                    tenants.key_stats_of(lambda: list(self.caches)) if args.per_key_cache else None)
        self.journal = Journal(digest_key(args.fleet_salt))
        self.model_provider: Any = None
        self._closing = threading.Event()
        self.tenancy = tenants.Tenancy() if args.per_key_cache else None

    def hooks(self) -> hooks.ServeHooks:
        return hooks.ServeHooks(on_run=self.on_run, make_cache=self.make_cache, handler=self.handler,
                                server_class=self.server_class(), before_serving=self.open_caches,
                                tenancy=self.tenancy)

    def on_run(self, model_provider: Any) -> None:
        """Only now, with every flag parsed: --help or a typo must not create directories."""
        self.model_provider = model_provider
        cli = model_provider.cli_args
        try:
            check_port(cli.host, cli.port)
        except OSError as e:
            print(f"blockkv serve: error: cannot listen on {cli.host}:{cli.port}: {e.strerror or e}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            self.args.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"blockkv serve: error: cannot create --cache-dir {self.args.cache_dir}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        default = ""
        if self.args.cache_bytes is None:
            default = " (the default: --cache-bytes SIZE or --cache-bytes 10% to change it)"
        held = stored_bytes(self.args.cache_dir)  # every model's directory there, as docs/cli.md's "on disk"
        log.info("blockkv: disk tier in %s holding %s, capped at %s%s", self.args.cache_dir, format_size(held),
                 describe(self.cache_bytes, self.args.cache_dir, held), default)

    def make_cache(self, max_size: int = 10, max_bytes: int = 1 << 63) -> ResidentPromptCache:
        cli = self.model_provider.cli_args
        kind: type[ResidentPromptCache] = ResidentPromptCache
        per_key: dict[str, Any] = {}
        if self.tenancy is not None:
            kind, per_key = tenants.PerKeyPromptCache, {"tenancy": self.tenancy, "key_share": self.args.key_share}
        cache = kind(
            max_size,
            max_bytes,
            journal=self.journal,
            model_key=(cli.model, cli.adapter_path, cli.draft_model),  # mlx-lm's key of the default model
            cache_dir=self.args.cache_dir,
            cache_bytes=self.cache_bytes,
            min_restore_tokens=self.args.min_restore_tokens,
            kv=KVQuant(cli.kv_bits, cli.kv_group_size, cli.quantized_kv_start),
            chat_template=cli.chat_template or None,
            remote=self.args.remote,
            remote_options=self.options,
            models=functools.partial(_loaded_models, self.model_provider),
            **per_key,
        )
        self.caches.append(cache)
        self.metrics.watch(cache)
        return cache

    def handler(self, base: type) -> type:
        """mlx-lm's handler with blockkv's paths, behind the API keys."""
        operator = tenants.is_operator(self.args.operators) if self.args.per_key_cache else None
        handler = health_handler(base, self.disk_tier)
        handler = residency_handler(handler, self.journal, operator) if self.publish else handler
        handler = flush_handler(handler, lambda: list(self.caches))
        handler = with_metrics_path(handler, self.metrics,
                                    tenants.metrics_view(self.args.operators) if self.args.per_key_cache else None)
        if self.args.per_key_cache:
            handler = tenants.tagging_handler(handler, self.args.operators)
        handler = shedding(with_keys(handler, self.keys))  # shed before the key is known: wrap the keyed class
        handler.timeout = self.args.client_timeout  # each read and write: an idle connection is closed
        return handler

    def server_class(self) -> type:
        """The HTTP server mlx-lm builds: connections admitted and bounded by blockkv's shedder."""
        return bounded_server_class("blockkv serve", self.args.max_connections, self.args.max_pending,
                                    self.args.header_timeout)

    def open_caches(self) -> None:
        """Open the default model's store before serving, so a restarted node
        publishes its disk at once; a model that is not a directory (a repo id)
        may still be downloading, and an identity hashed from half its files
        would be another model's: its store opens once mlx-lm has loaded it."""
        model = self.model_provider.cli_args.model
        if model is not None and Path(model).expanduser().is_dir():
            self._open_published()
        elif model is not None:
            threading.Thread(target=self._open_after_load, name="blockkv-open-after-load", daemon=True).start()

    def _open_after_load(self) -> None:
        while self.model_provider.model_key is None and not self._closing.wait(LOAD_POLL_S):
            pass
        if not self._closing.is_set():
            self._open_published()

    def _open_published(self) -> None:
        for cache in list(self.caches):
            cache.open_published()

    def disk_tier(self) -> tuple[str, str | None]:
        """The default model's disk tier, for ``/blockkv/health``."""
        caches = list(self.caches)
        return caches[0].disk_tier(caches[0].model_key) if caches else ("not open yet", None)

    def close(self) -> None:
        self._closing.set()
        for cache in self.caches:
            cache.close()
            stats = cache.tier_stats
            log.info(
                "blockkv: disk tier closed (%s): %d spills%s, %d failed, %d disk hits, %d bucket hits",
                cache.cache_dir, stats["spills"],
                f" ({stats['spills_not_uploaded']} not in the bucket yet)" if stats["spills_not_uploaded"] else "",
                stats["spill_failures"], stats["disk_hits"], stats["bucket_hits"],
            )


if __name__ == "__main__":
    sys.exit(main())
