"""FaultyFileLayer: the file-layer seam with faults a test can arm.

Every fault goes through ``blockkv.fs.FileLayer``'s primitives, so the store
runs its real code on a real directory and only the chosen syscall misbehaves:
ENOSPC or EIO from the k-th write, fsync or rename; a torn write that lands a
prefix of its bytes and then fails; or a ``SimulatedCrash`` at a named crash
point (or mid-write), which models the process dying there.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from blockkv.fs import Buffer, FileLayer

Op = Literal["write", "fsync", "replace"]
OPS: tuple[Op, ...] = ("write", "fsync", "replace")
CRASH_POINTS: tuple[str, ...] = (
    "store:blocks-written",
    "store:refs-taken",
    "store:header-written",
    "remove:header-unlinked",
    "gc:block-unlinked",
)


class SimulatedCrash(BaseException):
    """The process 'dies' here. A BaseException so that the store's
    ``except Exception`` recovery paths cannot swallow it, as they could not
    swallow a real SIGKILL."""


@dataclass
class _Armed:
    op: Op
    nth: int  # fire on this call of op counted from arming (1-based)
    err: int
    torn: bool
    times: int  # how many consecutive calls fail once it fires


class FaultyFileLayer(FileLayer):
    """A FileLayer whose write/fsync/replace can be made to fail and whose
    crash points can be made to raise. ``fired`` records what went off."""

    def __init__(self) -> None:
        self._armed: _Armed | None = None
        self._calls: Counter[str] = Counter()
        self._crash: tuple[str, int] | None = None
        self._crash_hits = 0
        self.fired: list[str] = []

    # -- arming -------------------------------------------------------------
    def fail(self, op: Op, nth: int = 1, err: int = errno.ENOSPC, *, times: int = 1) -> None:
        """Make the ``nth`` next call of ``op`` (and ``times - 1`` after it) raise ``err``."""
        self._arm(_Armed(op, nth, err, torn=False, times=times))

    def tear(self, nth: int = 1, err: int = errno.EIO) -> None:
        """Make the ``nth`` next write land only half its bytes, then raise ``err``."""
        self._arm(_Armed("write", nth, err, torn=True, times=1))

    def crash_at(self, point: str, nth: int = 1) -> None:
        """Raise SimulatedCrash the ``nth`` time the store reaches crash point ``point``."""
        if point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {point!r}; expected one of {CRASH_POINTS}")
        self._crash = (point, nth)
        self._crash_hits = 0

    def disarm(self) -> None:
        self._armed = None
        self._crash = None

    @property
    def armed(self) -> bool:
        return self._armed is not None or self._crash is not None

    def _arm(self, fault: _Armed) -> None:
        if fault.nth < 1 or fault.times < 1:
            raise ValueError("nth and times count from 1")
        self._calls.clear()
        self._armed = fault

    def _should_fail(self, op: Op) -> _Armed | None:
        fault = self._armed
        if fault is None or fault.op != op:
            return None
        self._calls[op] += 1
        if self._calls[op] < fault.nth:
            return None
        if self._calls[op] >= fault.nth + fault.times - 1:
            self._armed = None
        self.fired.append(f"{op}:{errno.errorcode.get(fault.err, fault.err)}{':torn' if fault.torn else ''}")
        return fault

    # -- the seam -----------------------------------------------------------
    def write(self, fd: int, buffers: Sequence[Buffer]) -> int:
        fault = self._should_fail("write")
        if fault is None:
            return super().write(fd, buffers)
        if fault.torn:
            view = memoryview(buffers[0]).cast("B")
            super().write(fd, [view[: len(view) // 2]])
        raise OSError(fault.err, f"injected {os.strerror(fault.err)} on write")

    def fsync(self, fd: int) -> None:
        fault = self._should_fail("fsync")
        if fault is not None:
            raise OSError(fault.err, f"injected {os.strerror(fault.err)} on fsync")
        super().fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        fault = self._should_fail("replace")
        if fault is not None:
            raise OSError(fault.err, f"injected {os.strerror(fault.err)} on rename")
        super().replace(src, dst)

    def crash_point(self, name: str) -> None:
        if self._crash is None or self._crash[0] != name:
            return
        self._crash_hits += 1
        if self._crash_hits == self._crash[1]:
            self._crash = None
            self.fired.append(f"crash:{name}")
            raise SimulatedCrash(name)
