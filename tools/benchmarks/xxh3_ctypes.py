"""xxh3-128 through ctypes straight into python-xxhash's own extension, whose
Linux build exports libxxhash's streaming functions: a call on a raw address
that drops the GIL (ctypes does for every ``CDLL`` call), where
``xxhash.xxh3_128().update`` keeps it. Measured against that in
``tools/xxh3_calls.py`` (issue #45), with a native reader of a whole
block (``read_hash.c``); not used by the library."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import xxhash


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _library() -> ctypes.CDLL | None:
    """xxhash's extension with the XXH3 streaming symbols typed, or None where
    they are not exported (a build that hides them: we could check Linux only)."""
    lib = ctypes.CDLL(xxhash._xxhash.__file__)
    try:
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_reset.argtypes = [ctypes.c_void_p]
        # the _dispatch entry picks AVX2 as python-xxhash does; the plain one is SSE2 (~1.7x slower from cache)
        lib.XXH3_128bits_update_dispatch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_128bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_digest.restype = _Hash128
    except AttributeError:
        return None
    return lib


LIB = _library()


class Xxh3At:
    """One xxh3-128 fed ``(address, size)`` runs of memory the caller keeps alive;
    ``hexdigest`` equals ``xxhash.xxh3_128`` of the same bytes."""

    def __init__(self) -> None:
        if LIB is None:
            raise RuntimeError("this xxhash build does not export the XXH3 streaming functions")
        self._state = LIB.XXH3_createState()
        LIB.XXH3_128bits_reset(self._state)
        self.update_at = partial(LIB.XXH3_128bits_update_dispatch, self._state)  # no Python frame a call

    def update(self, data: bytes) -> None:
        self.update_at(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data))

    def hexdigest(self) -> str:
        d = LIB.XXH3_128bits_digest(self._state)
        return f"{d.high64:016x}{d.low64:016x}"

    def __del__(self) -> None:
        LIB.XXH3_freeState(self._state)



def native_reader(work: Path) -> Callable[..., int] | None:
    """``read_hash`` of read_hash.c, compiled with the system's ``cc`` into
    ``work`` and typed: None without a compiler or the XXH3 symbols."""
    source, built = Path(__file__).with_name("read_hash.c"), work / "read_hash.so"
    if LIB is None or shutil.which("cc") is None:
        return None
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    fn = ctypes.CDLL(str(built)).read_hash
    fn.restype = ctypes.c_longlong
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    return fn


def update_address() -> int:
    """The address of ``XXH3_128bits_update_dispatch``, for native code to call."""
    assert LIB is not None
    return ctypes.cast(LIB.XXH3_128bits_update_dispatch, ctypes.c_void_p).value or 0
