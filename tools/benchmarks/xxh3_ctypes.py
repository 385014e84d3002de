"""xxh3-128 through ctypes straight into python-xxhash's own extension, whose
Linux build exports libxxhash's streaming functions: a call on a raw address
that drops the GIL (ctypes does for every ``CDLL`` call), where
``xxhash.xxh3_128().update`` keeps it. Measured against that in
``tools/xxh3_calls.py`` (issue #45); not used by the library, which it did
not beat."""

from __future__ import annotations

import ctypes
from functools import partial

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

