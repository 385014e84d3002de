"""API keys for ``blockkv serve`` and ``blockkv route``: who may use a server
that is reachable on a network.

A request names its key as every OpenAI client sends its ``api_key``:
``Authorization: Bearer KEY``. It is compared with every configured key, each
comparison ``hmac.compare_digest`` of SHA-256 digests, so neither how long a
key is, nor where a guess first differs, nor which key matched shows in the
time taken. Every path needs a key except ``/health`` (a load balancer's
probe; it answers whether the server is up, nothing else), and so does every
method but ``OPTIONS`` (a browser's CORS preflight carries no credentials and
gets headers only). A refusal is 401
with an OpenAI-style error body and nothing more: no request is read, no
model runs.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one a line) and
``$BLOCKKV_API_KEY`` (several separated by commas); no key anywhere: no check.
A key is never logged or shown: the access log has no headers, and the
namespace a key's cache lives in (``--per-key-cache``) is a digest of it.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

KEY_ENV = "BLOCKKV_API_KEY"
NODE_KEY_ENV = "BLOCKKV_NODE_API_KEY"
OPEN_PATHS = frozenset({"/health"})
_REFUSED = json.dumps({"error": {
    "message": "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (the OpenAI client's api_key).",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeys:
    """The keys a server accepts; empty: every request is accepted."""

    def __init__(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str) or not key or key != key.strip() or not key.isprintable():
                raise ValueError("an API key must be a non-empty printable string without surrounding spaces")
        self._digests = [hashlib.sha256(key.encode()).digest() for key in dict.fromkeys(keys)]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"  # never the keys

    def match(self, authorization: str | None) -> bytes | None:
        """The digest of the key an ``Authorization`` header carries, or None
        if it carries none of ours. Every key is compared, whatever matched."""
        scheme, _, key = (authorization or "").partition(" ")
        given = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for digest in self._digests:
            if hmac.compare_digest(digest, given) and scheme.lower() == "bearer":
                found = digest
        return found


def namespace_of(digest: bytes) -> str:
    """The cache namespace of the key with this SHA-256 digest (``--per-key-cache``):
    stable across restarts, and saying nothing of the key."""
    return "key-" + hashlib.sha256(b"blockkv per-key cache\0" + digest).hexdigest()[:32]


def add_key_options(parser: argparse.ArgumentParser, who: str) -> None:
    """``--api-key`` and ``--api-key-file`` on ``parser``."""
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every path but /health (repeatable; also "
                        f"${KEY_ENV}, comma-separated; on the command line a key shows in ps: prefer the "
                        f"file or the variable). {who}")
    parser.add_argument("--api-key-file", type=Path, metavar="FILE",
                        help="API keys, one a line (blank lines and lines starting with # skipped)")


def keys_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ApiKeys:
    """The keys ``add_key_options``' flags and ``$BLOCKKV_API_KEY`` name.
    ``ValueError`` for an empty or unreadable file (a typo must not open the server)."""
    environ = os.environ if environ is None else environ
    keys = list(args.api_key)
    keys += [k.strip() for k in environ.get(KEY_ENV, "").split(",") if k.strip()]
    if args.api_key_file is not None:
        keys += read_key_file(args.api_key_file, "--api-key-file")
    return ApiKeys(keys)


def read_key_file(path: Path, flag: str) -> list[str]:
    """The keys in a file, one a line (blank lines and lines starting with # skipped);
    ``ValueError`` naming ``flag`` if it cannot be read or holds none."""
    try:
        lines = path.expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{flag} {path}: holds no key")
    return keys


def bearer(key: str | None) -> dict[str, str]:
    """The header that sends ``key`` (none for None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def with_keys(handler_class: type[BaseHTTPRequestHandler], keys: ApiKeys) -> type[BaseHTTPRequestHandler]:
    """``handler_class`` refusing, before any ``do_*`` runs, a request to a
    path other than ``/health`` without one of ``keys``. The matched key's
    digest is left in ``self.api_key`` (None when ``keys`` is empty)."""
    if not keys:
        return handler_class

    class KeyedHandler(handler_class):  # type: ignore[misc, valid-type]
        api_key: bytes | None = None

        def parse_request(self) -> bool:
            if not super().parse_request():
                return False
            if self.command == "OPTIONS" or self.path.split("?", 1)[0] in OPEN_PATHS:
                return True  # a CORS preflight carries no credentials, and answers nothing
            self.api_key = keys.match(self.headers.get("Authorization"))
            if self.api_key is not None:
                return True
            refuse(self)
            return False

    return KeyedHandler


def refuse(handler: Any) -> None:
    """401, the OpenAI error body, and the connection closed (its body unread)."""
    handler.close_connection = True
    handler.send_response(401)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("WWW-Authenticate", 'Bearer realm="blockkv"')
    handler.send_header("Content-Length", str(len(_REFUSED)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(_REFUSED)
