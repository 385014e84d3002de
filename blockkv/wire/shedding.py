"""Shedding for a thread-per-connection HTTP server (``http.server``'s, which
``blockkv route`` runs and mlx-lm's server is): what a client can hold before
it has shown a key, or while it sends slowly, is bounded before it costs
anyone else a slot or memory.

- **Slots.** At most ``max_connections`` connections hold a thread. Of those,
  at most ``max_pending`` (fewer) may be *pending*: still sending their
  request's headers, so neither authenticated nor even known to be requests.
  A new connection that finds no room drops the oldest pending one (a client
  trickling its headers holds a slot only until newer ones arrive, so a
  keyed client, whose headers come in one packet, always gets in); only when
  every slot holds a connection past its headers is it answered 503 at once.
  The slots pending connections cannot take are left to requests that
  passed the key check.
- **Deadlines.** A pending connection must finish its headers within
  ``header_timeout`` of arriving (or, kept alive, of its last answer),
  however it trickles them; a body must arrive at ``MIN_BODY_RATE`` or
  better. A watchdog thread shuts the socket of one that does not
  (``shutdown`` wakes the thread blocked reading it). The handler's own
  ``timeout`` stays the idle timeout of each read and write.
- **Body memory.** ``BodyBudget`` bounds the request bodies held across all
  connections, reserved at their declared length before a byte is read; a
  body that does not fit is answered 503 with ``Retry-After``.

Errors are in OpenAI's shape (``openai_error``), so the ``openai`` client
shows the reason, not only the status.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # a request's line and headers, from the connection's arrival
MIN_BODY_RATE = 1 << 20  # bytes per second a body must arrive at, after HEADER_TIMEOUT_S of grace
PENDING_SHARE = 0.75  # of max_connections: the most that may be pending at once
SMALL_BODY = 1 << 20  # a body of at most this is an ordinary request's
LARGE_SHARE = 0.75  # of the body budget: the most that bodies over SMALL_BODY may hold together


def openai_error(message: str, kind: str, code: str) -> bytes:
    """An error body in OpenAI's shape: the ``openai`` client shows ``message``."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def error_response(status: int, reason: str, body: bytes, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.0 response closing the connection, for a socket no handler serves."""
    retry = b"Retry-After: %d\r\n" % retry_after if retry_after is not None else b""
    return (b"HTTP/1.0 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n%sContent-Length: %d\r\n\r\n%s"
            % (status, reason.encode(), retry, len(body), body))


def default_pending(max_connections: int) -> int:
    """The pending cap for ``max_connections``: ``PENDING_SHARE`` of it, at least 1 and below it where it can be."""
    return max(1, min(max_connections - 1, int(max_connections * PENDING_SHARE)))


@dataclass
class _Connection:
    pending: bool
    deadline: float | None  # time.monotonic() past which its socket is shut


class Shedder:
    """The connections a server holds: who is pending, their deadlines, and who is dropped for whom."""

    def __init__(self, max_connections: int, max_pending: int | None = None,
                 header_timeout: float = HEADER_TIMEOUT_S) -> None:
        max_pending = default_pending(max_connections) if max_pending is None else max_pending
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not 1 <= max_pending <= max_connections:
            raise ValueError(f"max_pending must be 1 to max_connections ({max_connections}), got {max_pending}")
        if not header_timeout > 0:
            raise ValueError(f"header_timeout must be positive, got {header_timeout}")
        self.max_connections, self.max_pending, self.header_timeout = max_connections, max_pending, header_timeout
        self._held: dict[socket.socket, _Connection] = {}  # arrival order: the oldest first
        self._changed = threading.Condition()
        self._stopped = False
        self.dropped = 0  # pending connections dropped for newer ones or past their deadline
        self._watchdog = threading.Thread(target=self._watch, name="blockkv-shedder", daemon=True)
        self._watchdog.start()

    def counts(self) -> tuple[int, int]:
        """(connections held, of which pending)."""
        with self._changed:
            return len(self._held), sum(c.pending for c in self._held.values())

    def arrive(self, sock: socket.socket) -> bool:
        """A new connection: held as pending (dropping the oldest pending one if
        there is no room), or False when every slot is past its headers (503)."""
        with self._changed:
            pending = [s for s, c in self._held.items() if c.pending]
            if len(self._held) >= self.max_connections or len(pending) >= self.max_pending:
                if not pending:
                    return False
                self._drop(pending[0])
            self._held[sock] = _Connection(True, time.monotonic() + self.header_timeout)
            self._changed.notify_all()
            return True

    def awaiting(self, sock: socket.socket) -> None:
        """The connection waits for a request's headers (again, kept alive): pending, with a header deadline."""
        with self._changed:
            held = self._held.get(sock)
            if held is not None and not held.pending:
                self._held[sock] = _Connection(True, time.monotonic() + self.header_timeout)
                self._changed.notify_all()

    def admitted(self, sock: socket.socket) -> bool:
        """Its headers arrived and passed the key check: no longer pending, no
        deadline. False if it was dropped meanwhile (its headers ended by the
        shutdown, not by the client): it must not be served."""
        return self._set(sock, None)

    def expect_body(self, sock: socket.socket, length: int) -> None:
        """It is sending a body of ``length`` bytes: the deadline ``MIN_BODY_RATE`` implies."""
        self._set(sock, time.monotonic() + self.header_timeout + length / MIN_BODY_RATE)

    def body_read(self, sock: socket.socket) -> None:
        self._set(sock, None)

    def _set(self, sock: socket.socket, deadline: float | None) -> bool:
        with self._changed:
            if sock not in self._held:
                return False
            self._held[sock] = _Connection(False, deadline)
            self._changed.notify_all()
            return True

    def left(self, sock: socket.socket) -> None:
        """The connection is done (call before its socket is closed: a closed one is never shut here)."""
        with self._changed:
            self._held.pop(sock, None)
            self._changed.notify_all()

    def _drop(self, sock: socket.socket) -> None:
        """Shut ``sock`` (its thread's read returns at once) and stop counting it; under the lock."""
        del self._held[sock]
        self.dropped += 1
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    def _watch(self) -> None:
        with self._changed:
            while not self._stopped:
                now = time.monotonic()
                for sock in [s for s, c in self._held.items() if c.deadline is not None and c.deadline <= now]:
                    log.debug("blockkv: a connection missed its deadline; closed")
                    self._drop(sock)
                deadlines = [c.deadline for c in self._held.values() if c.deadline is not None]
                self._changed.wait(min(deadlines) - now if deadlines else None)

    def drain(self, bound: float) -> int:
        """Wait up to ``bound`` seconds for every connection to finish; how many had not."""
        deadline = time.monotonic() + bound
        with self._changed:
            while self._held and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return len(self._held)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


class BodyBudget:
    """The bytes of request bodies held across all connections, at most
    ``limit``. Bodies over ``SMALL_BODY`` may take only ``LARGE_SHARE`` of it:
    the rest is kept for ordinary requests (a 128k-token prompt is about
    0.5 MiB of JSON), so a few huge bodies never make every request wait."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the body memory budget must be at least 1 byte, got {limit}")
        self.limit = limit
        self._held = 0
        self._large = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        """Take ``n`` bytes of the budget, if they are free (never waits)."""
        large = n > SMALL_BODY
        with self._lock:
            if self._held + n > self.limit or (large and self._large + n > self.limit * LARGE_SHARE):
                return False
            self._held += n
            self._large += n if large else 0
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._held -= n
            self._large -= n if n > SMALL_BODY else 0

    def held(self) -> int:
        with self._lock:
            return self._held


def shedding(handler_class: type[BaseHTTPRequestHandler]) -> type[BaseHTTPRequestHandler]:
    """``handler_class`` telling its server's ``shedder`` when a connection waits
    for headers and when they arrived and passed ``parse_request`` (the key
    check included: wrap the keyed class)."""

    class SheddingHandler(handler_class):  # type: ignore[misc, valid-type]
        server: Any

        def handle_one_request(self) -> None:
            self.server.shedder.awaiting(self.connection)
            super().handle_one_request()

        def parse_request(self) -> bool:
            if super().parse_request() and self.server.shedder.admitted(self.connection):
                return True
            self.close_connection = True
            return False

    return SheddingHandler
