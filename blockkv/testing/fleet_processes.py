"""A fleet on one machine, as a user starts it: ``blockkv serve`` nodes and
``blockkv route`` as their own processes on 127.0.0.1, each logging to a
file. For the fleet tests and tools/route_bench.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

START_BOUND_S = 180.0  # a process that is not serving by then has failed (a safety bound, not a timing claim)
# mlx-lm's server itself sometimes aborts in interpreter teardown after a stop
# signal (reproduced with plain `mlx_lm server`, more often on a loaded machine):
# by then blockkv has flushed and closed, so that abort alone is a clean exit.
MLX_LM_TEARDOWN_ABORT = "terminate called without an active exception"


def exited_cleanly(code: int | None, log: str) -> bool:
    """Whether a stopped server's exit status and log say it stopped as it should."""
    return code == 0 or (code == -signal.SIGABRT and MLX_LM_TEARDOWN_ABORT in log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """``python -m blockkv ARGS --host HOST --port <port, else a free one>``, output in ``log``;
    reached on 127.0.0.1 (``host`` is where it listens: 127.0.0.1 unless a test needs another).
    ``program`` is what follows ``python -m``: another server for a head-to-head, as
    ``("mlx_lm", "server")``."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, port: int | None = None,
                 host: str = "127.0.0.1", program: tuple[str, ...] = ("blockkv",)) -> None:
        self.args, self.env, self.host, self.program = args, env, host, program
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", *program, *args, "--host", host,
                                          "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})

    def get(self, path: str, timeout: float = 10.0) -> Any:
        """GET ``path``: its JSON body."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())

    def wait_ready(self, bound: float = START_BOUND_S) -> None:
        """Until ``/health`` answers; RuntimeError (with the log) if the process
        exits or ``bound`` seconds pass first."""
        deadline = time.monotonic() + bound
        while True:
            try:
                self.get("/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"{self.url} did not come up:\n{self.log.read_text()}") from None
                time.sleep(0.05)  # a refused connect costs nothing: every start waits a poll less

    def restarted(self, log: Path) -> Process:
        """The same command on the same port (this process has exited), output in ``log``."""
        return Process(self.args, log, self.env, self.port, self.host, self.program)

    def stop(self, bound: float = 60.0) -> int | None:
        """SIGTERM, as a service manager stops it (a node flushes its spills; unlike
        Ctrl-C it is not ignored in a background job), then kill after ``bound``
        seconds; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stopped_cleanly(self, bound: float = 60.0) -> bool:
        """``stop``, then whether it exited as it should (``exited_cleanly``)."""
        return exited_cleanly(self.stop(bound), self.log.read_text())
