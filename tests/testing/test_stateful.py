"""The BlockStore ⇄ ReferenceStore state machine under the active hypothesis
profile (``ci`` by default; ``HYPOTHESIS_PROFILE=deep`` for the long run)."""

from __future__ import annotations

from blockkv.testing.stateful import BlockStoreMachine

TestBlockStoreMachine = BlockStoreMachine.TestCase
