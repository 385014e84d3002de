"""Testing kit: an oracle of the store's rules, hypothesis strategies, a
state machine users can subclass, and a fault-injecting file layer."""

from blockkv.testing.reference import (
    ModelCheckpoint,
    ModelEntry,
    ReferenceStore,
    StoreOutcome,
    checkpoint_ns,
    common_prefix_len,
)

__all__ = [
    "ModelCheckpoint",
    "ModelEntry",
    "ReferenceStore",
    "StoreOutcome",
    "checkpoint_ns",
    "common_prefix_len",
]
