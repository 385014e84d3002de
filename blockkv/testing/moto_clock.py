"""A seam for the S3 server's clock: moto's server with a ``Last-Modified``
that can be stepped, so tests and tools can reproduce a server whose host
clock jumps (NTP stepping the host of a self-hosted Garage, Ceph RGW or
SeaweedFS) while the bucket itself stays real.

moto stamps every object it stores with ``moto.s3.models.utcnow()``; the
seam replaces that one function with the real time plus an offset. In the
process that runs the server (``ThreadedMotoServer`` in a test, or this
module run as its own server process)::

    clock = ServerClock.install()   # in-process: clock.step(30) moves it 30 s ahead
    python -m blockkv.testing.moto_clock --port 5000 --clock-file /path/offset

With ``--clock-file`` the offset is the number in that file (seconds; read
again whenever the file changes), so a parent process steps the server's
clock by rewriting it (``write_offset``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
from pathlib import Path
from typing import Any


class ServerClock:
    """moto's object clock, ``offset`` seconds from the real one."""

    def __init__(self, offset_file: Path | None = None) -> None:
        self.offset = 0.0
        self._file = offset_file
        self._seen: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._original: Any = None

    @classmethod
    def install(cls, offset_file: Path | None = None) -> ServerClock:
        """Replace moto's clock in this process (where its server runs)."""
        from moto.s3 import models

        clock = cls(offset_file)
        clock._original = models.utcnow
        models.utcnow = clock.now
        return clock

    def uninstall(self) -> None:
        from moto.s3 import models

        if self._original is not None:
            models.utcnow = self._original
            self._original = None

    def step(self, seconds: float) -> None:
        with self._lock:
            self.offset += seconds

    def now(self) -> datetime.datetime:
        if self._file is not None:
            self._reload(self._file)
        return datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=self.offset)

    def _reload(self, file: Path) -> None:
        try:
            st = os.stat(file)
            seen = (st.st_mtime_ns, st.st_size)
            if seen != self._seen:
                value = float(file.read_text().strip() or 0)
                with self._lock:
                    self.offset, self._seen = value, seen
        except (OSError, ValueError):
            pass  # a file being rewritten: the last offset stands


def write_offset(path: Path, seconds: float) -> None:
    """Set the offset of a server started with ``--clock-file path`` (atomically)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{seconds}\n")
    os.replace(tmp, path)


def serve(port: int, clock_file: Path | None) -> None:
    """moto's S3 server on 127.0.0.1:``port`` with a steppable clock, until killed."""
    from moto.server import ThreadedMotoServer

    ServerClock.install(clock_file)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    threading.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--clock-file", type=Path)
    args = parser.parse_args()
    serve(args.port, args.clock_file)
