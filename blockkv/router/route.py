"""``blockkv route``: one OpenAI-compatible address for a fleet of ``blockkv
serve`` nodes, sending each request where it should start fastest.

This module is the HTTP front; placement.py chooses the node: it tokenizes a
request as the nodes will (route_tokens.py), looks up how much of it each node
holds in RAM, on its disk or (fleet-wide) in the bucket (fleet.py, from the
nodes' residency events) and weighs that against what is queued on each
(scoring.py). The front relays the request to the best node, then the
node's answer back byte for byte, streamed as it comes, with
``X-Blockkv-Node: <url>``. A conversation's next turn follows the node that
served the last one because that node now holds it; no session id is needed.

A node that refuses the connection or does not answer in time is skipped
(the next best one gets the request) and retried with backoff. The router
holds nothing that cannot be lost: restarted, it learns again from the nodes.
Whatever goes wrong in the router's own bookkeeping costs at worst a request
sent to a node that must prefill it, never a different answer: every answer
is a node's.
"""

from __future__ import annotations

import argparse
import codecs
import http.client
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import FrameType
from typing import Any

from blockkv.router.fleet import Node
from blockkv.router.placement import Router
from blockkv.router.route_tokens import CHAT_PATHS, TEXT_PATHS, PromptTokenizer
from blockkv.wire.auth import (
    NODE_KEY_ENV,
    TENANT_HEADER,
    ApiKeys,
    add_key_options,
    keys_from,
    namespace_of,
    read_key_file,
    with_keys,
)
from blockkv.wire.bounded_server import CLIENT_TIMEOUT_S, MAX_CONNECTIONS, BoundedHTTPServer, add_connection_options
from blockkv.wire.residency import SALT_ENV
from blockkv.wire.shedding import (
    HEADER_TIMEOUT_S,
    LARGE_SHARE,
    BodyBudget,
    openai_error,
    shedding,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413)
BODY_MEMORY = 256 << 20  # the request bodies held across all connections: past it a request is answered 503
MIN_BODY_MEMORY = math.ceil(MAX_BODY_BYTES / LARGE_SHARE / (1 << 20)) << 20  # holds one largest body
# A longer request is routed by load alone: tokenizing costs the router ~120 bytes of memory and
MAX_ANSWER_BYTES = 1 << 30  # a node's answer is cut off past this
CONNECT_TIMEOUT_S = 3.0
DRAIN_S = 120.0  # on SIGTERM or Ctrl-C: longest wait for the answers being relayed
NODE_HEADER = "X-Blockkv-Node"
_DONE = b"data: [DONE]"
_PATH = re.compile(r"[\x21-\x7e]+")  # what a node is sent: printable ASCII, no space (RFC 3986's characters)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate",
               "proxy-authorization"}


class Handler(BaseHTTPRequestHandler):
    """Relays ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``."""

    router: Router  # set on the subclass made per server
    budget: BodyBudget  # and so is this: the request bodies held across its connections
    server: BoundedHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def parse_request(self) -> bool:
        """http.server's checks, then the path's: a path no node could be sent is the client's error (400)."""
        if not super().parse_request():
            return False
        if not _PATH.fullmatch(self.path):
            self._error(400, "the request path is not printable ASCII", "invalid_request_path")
            return False
        return True

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            self._relay("GET", None, None)
        elif self.path == "/health":
            self._health()
        else:
            self._error(404, f"no such path: {self.path}", "not_found")

    def _health(self) -> None:
        """503 with no node up and taking the router's key: a balancer in front sends elsewhere."""
        nodes = self.router.nodes
        status = ("ok" if any(n.up and not n.key_refused for n in nodes) else "no node up"
                  if not any(n.up for n in nodes) else "every node up refuses the router's key: "
                  f"check --node-api-key-file (else ${NODE_KEY_ENV})")
        costs = self.router.restores.costs()
        self._reply(200 if status == "ok" else 503, {"status": status, "nodes": {
            n.url: {"up": n.up, "key_refused": n.key_refused, "residency": n.block_size > 0,
                    "in_flight": n.queue()[1]} for n in nodes},
            "active_cost": round(self.router.active.cost(), 1),
            "restore_costs": {"disk": round(costs.disk, 5), "bucket": round(costs.bucket, 5)}})

    def do_POST(self) -> None:
        if self.path not in (*CHAT_PATHS, *TEXT_PATHS):
            self._error(404, f"no such path: {self.path}", "not_found")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "a Content-Length header is required", "length_required")
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._error(413, f"the request body is over {MAX_BODY_BYTES} bytes", "request_too_large")
            return
        if not self.budget.reserve(length):  # reserved at its declared length, before a byte is read
            self.close_connection = True
            self._error(503, f"blockkv route: the request bodies being received take all of --body-memory "
                        f"({self.budget.limit >> 20} MiB); retry shortly", "body_memory_full", "server_error",
                        retry_after=1)
            return
        try:
            body = self._body(length)
            if body is None:
                return
            if not _is_utf8(body):
                self._error(400, "the request body is not UTF-8", "invalid_body")
                return
            self._relay("POST", body, self.router.prompt(self.path, body))
        finally:
            self.budget.release(length)

    def _body(self, length: int) -> bytearray | None:
        """The request's body, read into one buffer of its length (bytes read in
        pieces would be held twice), by the deadline its length allows; None if
        the client stalled or left (nothing to answer)."""
        body, shedder = bytearray(length), self.server.shedder
        shedder.expect_body(self.connection, length)
        try:
            got = self.rfile.readinto(body)
        except OSError as e:
            log.debug("blockkv route: request body not received (%r)", e)
            got = 0
        finally:
            shedder.body_read(self.connection)
        if got < length:
            self.close_connection = True
            return None
        return body

    def _relay(self, method: str, body: bytearray | None, tokens: list[int] | None) -> None:
        """Send the request to the best node that answers and takes the router's
        key; relay its answer."""
        router = self.router
        request_id = router.next_id()
        refused = []
        key = getattr(self, "api_key", None)  # the client's (auth.with_keys), with keys
        ns = namespace_of(key) if router.per_key and key is not None else ""
        for node, start in router.candidates(tokens, request_id, ns):  # queued there from now: its prefill may start
            try:
                conn, response = self._send(node, method, body, ns)
            except (OSError, http.client.HTTPException) as e:
                node.abandon(request_id)
                node.failed(e)
                continue
            except Exception as e:  # noqa: BLE001 - not the node's fault, and nothing was relayed yet
                node.abandon(request_id)
                log.warning("blockkv route: %s %s not sent to %s (%r)", method, self.path, node.url, e)
                self._error(500, "blockkv route: the router could not send the request", "relay_failed",
                            "server_error")
                return
            node.answered()
            if node.refuses_key(response.status == 401):  # the router's own key: never the client's to fix
                conn.close()
                node.abandon(request_id)
                refused.append(node.url)
                continue
            log.debug("blockkv route: %s -> %s (%s, %d tokens reused)", self.path, node.url, start.tier, start.reused)
            try:
                self._answer(node, request_id, response)
            finally:
                conn.close()
                node.end(request_id)
            return
        if refused:
            self._error(502, f"blockkv route: {', '.join(refused)} refused the key this router sends them: check "
                        f"--node-api-key-file (else ${NODE_KEY_ENV}); the client's own key is not at fault",
                        "node_key_refused", "server_error")
        else:
            self._error(503, "blockkv route: no blockkv serve node answered", "no_node_answered", "server_error",
                        retry_after=1)

    def _send(self, node: Node, method: str, body: bytearray | None,
              ns: str) -> tuple[http.client.HTTPConnection, Any]:
        conn = node.connection(CONNECT_TIMEOUT_S)
        try:
            conn.connect()
            conn.sock.settimeout(self.router.node_timeout)  # the first byte may wait for a long prefill
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json"), **node.headers,
                       **({TENANT_HEADER: ns} if ns else {})}
            conn.request(method, node.prefix + self.path, body=body, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _answer(self, node: Node, request_id: int, response: http.client.HTTPResponse) -> None:
        """The node's status, headers and body, relayed as they arrive (an SSE stream chunk by chunk)."""
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != NODE_HEADER.lower():
                self.send_header(name, value)
        self.send_header(NODE_HEADER, node.url)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()
        stream = response.status == 200 and response.getheader("Content-Type", "").startswith("text/event-stream")
        sent, tail, why = 0, b"", "the node closed it"
        try:
            while sent < MAX_ANSWER_BYTES:
                chunk = response.read1(64 << 10)
                if not chunk:
                    break
                if b"data: " in chunk:
                    node.started(request_id)  # a token streamed back: its prefill is over
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += len(chunk)
                tail = (tail + chunk)[-64:]
            else:
                why = f"over {MAX_ANSWER_BYTES} bytes"
        except (OSError, http.client.HTTPException) as e:  # the node died, or the client left: cut short
            log.warning("blockkv route: relaying the answer of %s ended early (%s)", node.url, e)
            why = repr(e)
        self.close_connection = True
        if stream and _DONE not in tail:
            self._cut(node, tail, why)

    def _cut(self, node: Node, tail: bytes, why: str) -> None:
        """End a stream its node did not finish with an error event, so that the
        client (the ``openai`` client raises ``APIError``) never takes a partial
        answer for a whole one."""
        log.warning("blockkv route: the answer streamed by %s ended without [DONE] (%s); the client is told", node.url,
                    why)
        event = json.dumps({"error": {"message": f"blockkv route: the answer of {node.url} was cut short ({why})",
                                      "type": "server_error", "code": "stream_cut"}})
        try:
            self.wfile.write((b"" if tail.endswith(b"\n\n") else b"\n\n") + f"data: {event}\n\n".encode())
            self.wfile.flush()
        except OSError:
            pass  # the client left

    def _error(self, status: int, message: str, code: str, kind: str = "invalid_request_error",
               retry_after: int | None = None) -> None:
        """The router's own error, in OpenAI's shape (the ``openai`` client shows ``message``)."""
        self._send_json(status, openai_error(message, kind, code),
                        {"Retry-After": str(retry_after)} if retry_after is not None else {})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self._send_json(status, json.dumps(body).encode(), {})

    def _send_json(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


def _is_utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8, checked a MiB at a time (decoded whole, a large body would be held 4 times over)."""
    decoder, view = codecs.getincrementaldecoder("utf-8")(), memoryview(data)
    try:
        for i in range(0, len(view), 1 << 20):
            decoder.decode(view[i : i + (1 << 20)])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def serve(router: Router, host: str, port: int, keys: ApiKeys = ApiKeys(()),
          client_timeout: float = CLIENT_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
          max_pending: int | None = None, header_timeout: float = HEADER_TIMEOUT_S,
          body_memory: int = BODY_MEMORY) -> BoundedHTTPServer:
    """An HTTP server for ``router`` on ``host:port`` (not yet serving), answering only ``keys`` if any."""
    if not client_timeout > 0:
        raise ValueError(f"--client-timeout must be positive, got {client_timeout}")
    if body_memory * LARGE_SHARE < MAX_BODY_BYTES:
        raise ValueError(f"--body-memory must be at least {MIN_BODY_MEMORY >> 20} MiB: its share for large bodies "
                         f"must hold one of the largest ({MAX_BODY_BYTES >> 20} MiB)")
    handler = shedding(with_keys(type("RouteHandler", (Handler,), {
        "router": router, "timeout": client_timeout, "budget": BodyBudget(body_memory)}), keys))
    return BoundedHTTPServer((host, port), handler, max_connections, max_pending, header_timeout)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockkv route", description="An OpenAI-compatible front for a fleet of "
                                "blockkv serve nodes: each request goes where its prompt is already cached.")
    p.add_argument("--model", required=True, metavar="PATH_OR_REPO",
                   help="the nodes' --model (only its tokenizer is loaded)")
    p.add_argument("--node", action="append", required=True, metavar="URL",
                   help="a blockkv serve node, http://HOST:PORT (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--fleet-salt", metavar="SECRET",
                   help=f"the nodes' --fleet-salt (default: ${SALT_ENV}, else none)")
    p.add_argument("--node-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for a node's next byte, prefill included (default: %(default)s)")
    add_connection_options(p)
    p.add_argument("--body-memory", type=int, default=BODY_MEMORY >> 20, metavar="MIB",
                   help="the request bodies held at once across all connections; a request past it is answered 503 "
                   f"(default: %(default)s; at least {MIN_BODY_MEMORY >> 20}: bodies over 1 MiB may take 3/4 of it, "
                   f"and one may be {MAX_BODY_BYTES >> 20} MiB)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_S, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, longest wait for the answers being relayed (default: %(default)s)")
    p.add_argument("--chat-template", default="", help="the nodes' --chat-template, if they use one")
    p.add_argument("--chat-template-args", type=json.loads, default={}, metavar="JSON",
                   help="the nodes' --chat-template-args, if they use them")
    p.add_argument("--use-default-chat-template", action="store_true", help="if the nodes use it")
    p.add_argument("--trust-remote-code", action="store_true", help="if the nodes use it")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_key_options(p, "The clients' keys: the nodes get --node-api-key-file's instead.")
    p.add_argument("--per-key-cache", action="store_true",
                   help="the nodes run 'serve --per-key-cache' and this router's node key is one of their "
                   "--operator-key-file keys: each request is placed by its client key's own residency (and the "
                   "shared namespace's) and served in that key's cache")
    p.add_argument("--node-api-key-file", type=Path, metavar="FILE",
                   help=f"the key this router sends every node (one of the nodes' --api-key; default "
                   f"${NODE_KEY_ENV}): the clients' keys stay the router's to check, and the residency it "
                   "follows has no client to borrow one from")
    return p


def _node_key(args: argparse.Namespace) -> str | None:
    """The key sent to the nodes: the file's one key, else ``$BLOCKKV_NODE_API_KEY``."""
    if args.node_api_key_file is None:
        return os.environ.get(NODE_KEY_ENV) or None
    keys = read_key_file(args.node_api_key_file, "--node-api-key-file")
    if len(keys) != 1:
        raise ValueError(f"--node-api-key-file {args.node_api_key_file}: must hold one key")
    return keys[0]


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        nodes = [Node(url).url for url in args.node]  # checked before the tokenizer loads
        if not isinstance(args.chat_template_args, dict):
            raise TypeError("--chat-template-args must be a JSON object")
        tokenizer = PromptTokenizer(args.model, chat_template=args.chat_template or None,
                                    chat_template_args=args.chat_template_args,
                                    use_default_chat_template=args.use_default_chat_template,
                                    trust_remote_code=args.trust_remote_code)
        keys = keys_from(args)
        if args.per_key_cache and not keys:
            raise ValueError("--per-key-cache needs the clients' API keys (--api-key, --api-key-file or "
                             "$BLOCKKV_API_KEY)")
        router = Router(nodes, tokenizer, args.fleet_salt, args.node_timeout, node_key=_node_key(args),
                        per_key=args.per_key_cache)
        server = serve(router, args.host, args.port, keys, args.client_timeout, args.max_connections,
                       args.max_pending, args.header_timeout, args.body_memory << 20)
    except (ValueError, TypeError, OSError) as e:
        parser.exit(2, f"blockkv route: error: {e}\n")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    router.start()
    log.info("blockkv route: listening on http://%s:%d for %d nodes", args.host, server.server_address[1], len(nodes))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        # stop accepting, let the answers being relayed finish (a second signal ends the wait), then go
        log.info("blockkv route: stopping; relaying the answers in flight (up to %g s)", args.drain_timeout)
        try:
            if left := server.drain(args.drain_timeout):
                log.warning("blockkv route: %d answers still being relayed after %g s are cut", left,
                            args.drain_timeout)
        finally:
            router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
