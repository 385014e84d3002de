"""Testing kit: an oracle of the store's rules, hypothesis strategies, a
state machine users can subclass, and a fault-injecting file layer.

``BlockStoreMachine`` imports the store, so it is loaded on first use."""

from typing import Any

from blockkv.testing.faults import CRASH_POINTS, FaultyFileLayer, SimulatedCrash
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
    "FakeClock",
    "FaultyFileLayer",
    "ModelCheckpoint",
    "ModelEntry",
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
    raise AttributeError(name)
