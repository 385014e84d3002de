"""The router's HTTP server: ``http.server``'s threading server with every
resource a client can hold bounded (shedding.py), and a shutdown that drops
nothing in flight.

- a connection is served by a thread of its own, at most ``max_connections``
  at once, of which at most ``max_pending`` still sending their headers; a new
  one drops the oldest of those when there is no room, and is answered 503 at
  once only when every slot holds a request past its headers;
- the listen backlog is 128 (``http.server``'s 5 reset a burst of clients);
- ``drain`` stops accepting (the listening socket is closed, so a new client is
  refused at once rather than left waiting) and waits, up to a bound, for the
  connections being served to finish.

The idle timeout of each read and write is the handler's ``timeout``, set by
whoever makes the handler class; the handler class must be ``shedding()``'s.
"""

from __future__ import annotations

import logging
import socket
import sys
from http.server import ThreadingHTTPServer
from typing import Any

from blockkv.wire.shedding import (
    HEADER_TIMEOUT_S,
    Shedder,
    error_response,
    openai_error,
)

log = logging.getLogger(__name__)

BUSY = error_response(503, "Service Unavailable", openai_error(
    "blockkv route: every connection slot is serving a request; retry shortly", "server_error",
    "too_many_connections"), retry_after=1)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` whose connections a ``Shedder`` admits, that drains on shutdown."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int,
                 max_pending: int | None = None, header_timeout: float = HEADER_TIMEOUT_S) -> None:
        self.shedder = Shedder(max_connections, max_pending, header_timeout)
        self._warned_full = False
        try:
            super().__init__(address, handler)
        except BaseException:
            self.shedder.stop()
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.shedder.arrive(request):
            if not self._warned_full:
                log.warning("blockkv route: %d requests at once; more are answered 503",
                            self.shedder.max_connections)
                self._warned_full = True
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            super().shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.shutdown_request(request)
            raise

    def shutdown_request(self, request: Any) -> None:
        self.shedder.left(request)  # before the close: the shedder never shuts a closed socket's number
        super().shutdown_request(request)

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
        try:
            return self.shedder.drain(bound)
        finally:
            self.shedder.stop()
