"""``export``, ``import`` and ``warm``: prompt-cache files out of and into a
root, and a system prompt's cache stored before the first request.

``import`` and ``warm`` store under the identity ``blockkv serve --model``
gives the same model and flags (``--kv-bits``, ``--chat-template``, ...), so
the server finds what they stored. mlx-lm, the model and the tokenizer are
imported only when one of these runs (``blockkv --help`` stays cheap).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blockkv.cli.common import (
    EXIT_OK,
    UsageError,
    check_root,
    emit_json,
    entry_json,
    fp_json,
    label,
    one_entry,
    select_fingerprints,
)
from blockkv.human import format_size, parse_count


def add_identity_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The flags of ``blockkv serve`` that decide a store's identity."""
    p.add_argument("--model", required=required, metavar="PATH",
                   help="the model as 'blockkv serve --model' names it (a directory or a downloaded repo)")
    p.add_argument("--adapter-path", metavar="PATH", help="as given to serve")
    p.add_argument("--draft-model", metavar="PATH", help="as given to serve")
    p.add_argument("--kv-bits", type=int, help="as given to serve (KV quantisation is part of the identity)")
    p.add_argument("--kv-group-size", type=int, default=64, help="as given to serve (default: 64)")
    p.add_argument("--quantized-kv-start", type=int, default=None,
                   help="as given to serve (default: mlx-lm server's)")
    p.add_argument("--chat-template", default="", help="as given to serve")


def add_commands(sub: Any, make: Any) -> None:
    """``export``, ``import`` and ``warm`` on the parser's subcommands (``make``
    builds a subparser the way ``blockkv.cli`` builds every other one)."""
    export = make("export", cmd_export, "write an entry as a .safetensors prompt-cache file mlx-lm loads")
    export.add_argument("root", nargs="?", help="cache root (default: serve's, by platform: docs/cli.md)")
    export.add_argument("entry", help="entry id (or a unique prefix), as 'blockkv ls' shows it; 'latest': the "
                        "entry used last (the conversation a server served last)")
    export.add_argument("-o", "--output", required=True, metavar="FILE.safetensors", help="the file to write")
    export.add_argument("-f", "--fingerprint", metavar="FP", help="the entry's fingerprint (or --model)")
    export.add_argument("--prefix-len", type=parse_count, metavar="N", help="only the first N tokens")
    export.add_argument("--as-model", metavar="PATH_OR_REPO",
                        help="the file's 'model', which 'mlx_lm.generate --model' must equal (default: --model; "
                        "with -f, the store's model id, a name that is no path: give the path here)")
    export.add_argument("--flush", metavar="URL", help="first ask the blockkv serve at URL (http://HOST:PORT) to "
                        "finish writing what it holds, so a conversation it is serving is exported whole; its "
                        "API key from --api-key-file or $BLOCKKV_API_KEY")
    export.add_argument("--api-key-file", type=Path, metavar="FILE", help="the key --flush sends (the first in "
                        "the file, as serve reads it)")
    add_identity_options(export, required=False)
    imp = make("import", cmd_import, "store a .safetensors prompt-cache file (blockkv export's or "
               "mlx_lm.cache_prompt's) where 'blockkv serve --model' finds it")
    imp.add_argument("root", nargs="?", help="cache root (default: serve's, by platform: docs/cli.md; "
                     "created if missing)")
    imp.add_argument("file", help="the prompt-cache file")
    prompt = imp.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the text mlx_lm.cache_prompt was given (--prompt)")
    prompt.add_argument("--prompt-file", type=Path, help="the same, from a file")
    prompt.add_argument("--tokens", metavar="JSON", help="the prompt's token ids, a JSON list (or @FILE)")
    imp.add_argument("-n", "--namespace", default="", metavar="NS", help="store in this namespace (default '')")
    imp.add_argument("--unlabelled", action="store_true",
                     help="take a file whose metadata names no model (you vouch that --model made it)")
    add_identity_options(imp, required=True)
    warm = make("warm", cmd_warm, "store a system prompt's cache before the first request")
    warm.add_argument("root", nargs="?", help="cache root (default: serve's, by platform: docs/cli.md; "
                      "created if missing)")
    warm.add_argument("file", type=Path, help="a chat-messages JSON file (its leading system messages) "
                      "or a text file (the system prompt)")
    add_identity_options(warm, required=True)


# -- the commands -----------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from blockkv.mlx_lm.cache_files import export_prompt_cache

    if args.flush is not None:
        _flush(args)
    with _store_for_export(args) as (store, fp):
        entries = store.entries()
        if args.entry == "latest" and entries:
            entry = max(entries, key=lambda e: e.last_use)
        else:
            entry = one_entry(entries, args.entry, store.directory.name)
        model = args.as_model if args.as_model is not None else args.model
        path = export_prompt_cache(store, entry, args.output, prefix_len=args.prefix_len, model=model)
        tokens = args.prefix_len or entry.length
    out = {**fp, "entry": entry_json(entry), "tokens": tokens, "file": str(path), "bytes": path.stat().st_size}
    if args.json:
        emit_json(out)
    else:
        print(f"{label(fp)}: wrote {tokens} tokens of entry {entry.id} to {path} ({format_size(out['bytes'])})")
        if model is None:
            print(f"  its model is {store.identity.model_id!r}, a name: run mlx_lm.generate without --model, or "
                  "export with --as-model PATH (what mlx_lm.generate --model will say)")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from blockkv.mlx_lm.cache_files import read_for_import, store_imported

    # a refused file never opens the store
    caches, tokens = read_for_import(args.file, _identity(args), _prompt_tokens(args), layout=_layout(args),
                                     unlabelled=args.unlabelled)
    with _serve_store(args) as store:
        before = dict(store.stats)
        entry = store_imported(store, args.file, caches, tokens, args.namespace)
        if entry is None:
            raise OSError(f"{args.file} was not stored (the warning above says why)")
        written = int(store.stats["bytes_written"] - before["bytes_written"])
        shared = int(store.stats["bytes_deduplicated"] - before["bytes_deduplicated"])
        fp = _fp_of(store)
    out = {**fp, "entry": entry_json(entry), "bytes_written": written, "bytes_deduplicated": shared}
    if args.json:
        emit_json(out)
    else:
        print(f"{label(fp)}: imported {entry.length} tokens as entry {entry.id} (namespace {json.dumps(entry.ns)}): "
              f"{format_size(written)} written, {format_size(shared)} already stored")
    return EXIT_OK


def cmd_warm(args: argparse.Namespace) -> int:
    from blockkv.mlx_lm.warm import system_prompt_cache

    messages = _messages(args.file)
    if args.draft_model:
        raise UsageError("warm stores the model's own cache: a server with --draft-model keeps both in one list")
    with _serve_store(args) as store:
        tokens, caches = system_prompt_cache(args.model, messages, _kv(args), args.adapter_path,
                                             args.chat_template or None)
        if store.find_exact(tokens) is None:
            store.store(tokens, caches)  # False with remote= until the bucket has it: kept locally all the same
        match = store.find_exact(tokens)
        if match is None:
            raise OSError("the system prompt's cache was not stored (the warning above says why)")
        entry = match.entry
        fp = _fp_of(store)
    out = {**fp, "entry": entry_json(entry)}
    if args.json:
        emit_json(out)
    else:
        print(f"{label(fp)}: stored the system prompt's {entry.length} tokens as entry {entry.id}; "
              "the first request that starts with it restores them")
    return EXIT_OK


# -- helpers ----------------------------------------------------------------------


def _flush(args: argparse.Namespace) -> None:
    """``--flush URL``: the server has written every spill it started, or an OSError says why not."""
    import os

    from blockkv.node.flush import request_flush
    from blockkv.wire.auth import KEY_ENV, read_key_file

    if args.api_key_file is not None:
        try:
            key: str | None = read_key_file(args.api_key_file, "--api-key-file")[0]
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        key = os.environ.get(KEY_ENV, "").split(",")[0].strip() or None
    request_flush(args.flush, key, timeout=600.0)


def _kv(args: argparse.Namespace) -> Any:
    from blockkv.mlx_lm.identity import KVQuant

    start = args.quantized_kv_start
    if start is None:
        from mlx_lm.server import DEFAULT_QUANTIZED_KV_START as start  # what serve defaults to
    return KVQuant(args.kv_bits, args.kv_group_size, start)


def _layout(args: argparse.Namespace) -> Any:
    """The cache layout serve has for these flags: the model's own (and its
    draft model's), which an imported file's caches must fit."""
    from mlx_lm import load

    from blockkv.mlx_lm.cache_fit import ModelLayout
    from blockkv.mlx_lm.identity import resolve_model_path

    try:
        models = [load(str(resolve_model_path(args.model)), adapter_path=args.adapter_path)[0]]
        if args.draft_model:
            models.append(load(str(resolve_model_path(args.draft_model)))[0])
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    return ModelLayout(models, _kv(args))


def _identity(args: argparse.Namespace) -> Any:
    """The identity ``blockkv serve --model`` stores under for these flags."""
    from blockkv.mlx_lm.identity import identity_from_key

    try:
        return identity_from_key((args.model, args.adapter_path, args.draft_model), kv=_kv(args),
                                 chat_template=args.chat_template or None)
    except (FileNotFoundError, TypeError) as exc:
        raise UsageError(str(exc)) from None


@contextmanager
def _serve_store(args: argparse.Namespace) -> Iterator[Any]:
    """The store ``blockkv serve --model`` opens for these flags (the root is
    created if missing, as serve does)."""
    from blockkv.local.directory import ROOT_MARKER, default_root
    from blockkv.mlx_lm.prompt_cache import DEFAULT_CACHE_BYTES
    from blockkv.store import BlockStore

    root = Path(args.root).expanduser() if args.root else default_root()
    if root.is_dir() and any(root.iterdir()) and not (root / ROOT_MARKER).exists():
        raise UsageError(f"{root}: not a blockkv root (no {ROOT_MARKER} marker); refusing to touch it")
    ident = _identity(args)
    with BlockStore(root, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                    tokenizer_hash=ident.tokenizer_hash, max_bytes=DEFAULT_CACHE_BYTES) as store:
        yield store


@contextmanager
def _store_for_export(args: argparse.Namespace) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The store to export from, opened read-only: an export writes nothing
    under the root (no lock, no index, no last use), so it also works on a
    read-only mount or a snapshot."""
    from blockkv.local.directory import default_root
    from blockkv.local.read_only import ReadOnlyStore

    if args.model and args.fingerprint:
        raise UsageError("name the store by -f/--fingerprint or by --model, not both")
    root = check_root(args.root or str(default_root()))
    if args.model:
        ident = _identity(args)
        try:
            store = ReadOnlyStore(root, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                                  tokenizer_hash=ident.tokenizer_hash)
        except FileNotFoundError:
            raise UsageError(f"no store for --model {args.model} in {root}") from None
        with store:
            yield store, _fp_of(store)
        return
    fps = select_fingerprints(root, [args.fingerprint] if args.fingerprint else None, False, mutating=None)
    if len(fps) != 1:
        raise UsageError(f"{root} holds {len(fps)} fingerprints: name one with -f/--fingerprint or --model")
    with ReadOnlyStore.open_dir(fps[0].path) as store:
        yield store, fp_json(fps[0])


def _fp_of(store: Any) -> dict[str, Any]:
    from blockkv.format.layout import fingerprint_dirname
    from blockkv.local.directory import list_fingerprints

    name = fingerprint_dirname(store.identity.config_fingerprint)
    (fp,) = [fp for fp in list_fingerprints(store.root) if fp.path.name == name]
    return fp_json(fp)


def _prompt_tokens(args: argparse.Namespace) -> list[int] | None:
    """The tokens a cache_prompt file holds: the prompt tokenised as
    ``mlx_lm.cache_prompt`` does, or given; None: the file's own (an export's)."""
    if args.tokens is not None:
        text = Path(args.tokens[1:]).read_text() if args.tokens.startswith("@") else args.tokens
        try:
            tokens = json.loads(text)
        except ValueError:
            tokens = None
        if not isinstance(tokens, list):
            raise UsageError("--tokens takes a JSON list of token ids (or @FILE holding one)")
        return tokens
    if args.prompt is None and args.prompt_file is None:
        return None
    from blockkv.mlx_lm.identity import resolve_model_path
    from blockkv.mlx_lm.warm import cache_prompt_tokens

    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    return cache_prompt_tokens(resolve_model_path(args.model), text)


def _messages(path: Path) -> list[dict[str, str]]:
    """A chat-messages JSON file's leading system messages, or a text file as one."""
    text = path.read_text()
    if path.suffix != ".json":
        return [{"role": "system", "content": text}]
    try:
        messages = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise UsageError(f"{path}: expected a JSON list of chat messages ({{'role': ..., 'content': ...}})")
    system = []
    for m in messages:
        if m["role"] != "system":
            break
        system.append(m)
    if not system:
        raise UsageError(f"{path}: no system message at its start (the part serve caches for every user)")
    return system
