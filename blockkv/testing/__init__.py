"""Testing kit: an oracle of the store's rules (``reference``), hypothesis
``strategies``, a state machine users can subclass (``stateful``), a
fault-injecting file layer (``faults``), a recording one that produces
power-loss crash states (``powerloss``), ``PoolTests``, the tests every
``BlobPool`` backend must pass (``pool_tests``), ``BucketTests``, what the
bucket protocol needs of an S3-compatible server (``bucket_tests``), tiny real models
(``models``; a loadable model directory is ``blockkv.model_dir``'s), moto's S3 server with a steppable
clock (``moto_clock``), and serve nodes and routers as processes
(``fleet_processes``).

``BlockStoreMachine`` imports the store and ``PoolTests`` and ``BucketTests``
import pytest, so they are loaded on first use."""

from typing import Any

from blockkv.testing.faults import CRASH_POINTS, FaultyFileLayer, SimulatedCrash
from blockkv.testing.powerloss import CrashPoint, CrashState, RecordingFileLayer
from blockkv.testing.reference import (
    ModelCheckpoint,
    ModelEntry,
    ReferenceStore,
    StoreOutcome,
    checkpoint_ns,
    common_prefix_len,
)

__all__ = [
    "CRASH_POINTS",
    "BlockStoreMachine",
    "BucketTests",
    "CrashPoint",
    "CrashState",
    "FakeClock",
    "FaultyFileLayer",
    "ModelCheckpoint",
    "ModelEntry",
    "PoolTests",
    "RecordingFileLayer",
    "ReferenceStore",
    "SimulatedCrash",
    "StoreOutcome",
    "checkpoint_ns",
    "common_prefix_len",
]


def __getattr__(name: str) -> Any:
    if name in ("BlockStoreMachine", "FakeClock"):
        from blockkv.testing import stateful

        return getattr(stateful, name)
    if name == "PoolTests":
        from blockkv.testing.pool_tests import PoolTests

        return PoolTests
    if name == "BucketTests":
        from blockkv.testing.bucket_tests import BucketTests

        return BucketTests
    raise AttributeError(name)
