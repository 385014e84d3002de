"""The router's HTTP server: ``http.server``'s threading server with every
resource a client can hold bounded, and a shutdown that drops nothing in flight.

- a connection is served by a thread of its own, at most ``max_connections`` at
  once; one past that is answered 503 at once (the thread it would have taken is
  what an idle client would hold);
- the listen backlog is 128 (``http.server``'s 5 reset a burst of clients);
- ``drain`` stops accepting (the listening socket is closed, so a new client is
  refused at once rather than left waiting) and waits, up to a bound, for the
  connections being served to finish.

The per-connection timeout (an idle or half-sent request) is the handler's
``timeout``, set by whoever makes the handler class.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

_BUSY_BODY = b'{"error": "too many connections"}'
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` of at most ``max_connections`` threads that drains on shutdown."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._max_connections = max_connections
        self._active = 0
        self._changed = threading.Condition()
        self._warned_full = False
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._changed:
            full = self._active >= self._max_connections
            self._active += 0 if full else 1
        if full:
            if not self._warned_full:
                log.warning("blockkv route: %d connections at once; more are answered 503", self._max_connections)
                self._warned_full = True
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._finished()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left or stalled is no fault of the server's: one debug line, no traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, socket.timeout)):
            log.debug("blockkv route: client %s: %r", client_address, error)
        else:
            log.exception("blockkv route: serving client %s failed", client_address)

    def drain(self, bound: float) -> int:
        """Stop accepting, then wait up to ``bound`` seconds for the connections being
        served; how many were still being served at the bound."""
        self.server_close()
        deadline = time.monotonic() + bound
        with self._changed:
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return self._active
