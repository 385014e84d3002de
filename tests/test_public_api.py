"""The library's contract with its importers: docs/api.md's list of public
names is each module's ``__all__``, every name resolves, and each moved path
still imports, as the same module, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import blockkv
from blockkv import moved

API_MD = Path(__file__).parents[1] / "docs" / "api.md"
PUBLIC = ("blockkv", "blockkv.mlx_lm", "blockkv.testing")


def documented(module: str) -> set[str]:
    """The names api.md's "Public names" lists for ``module``."""
    line = re.search(rf"^- `{re.escape(module)}`: (.*)$", API_MD.read_text(), re.MULTILINE)
    assert line is not None, f"docs/api.md lists no public names for {module}"
    return set(re.findall(r"`([A-Za-z_]\w*)`", line.group(1)))


@pytest.mark.parametrize("name", PUBLIC)
def test_api_md_lists_exactly_the_exports(name: str) -> None:
    module = importlib.import_module(name)
    assert documented(name) == set(module.__all__)
    for attr in module.__all__:
        assert getattr(module, attr) is not None


def test_version_matches_the_package_metadata() -> None:
    from importlib.metadata import version

    assert blockkv.__version__ == version("blockkv")


def test_the_package_says_it_is_typed() -> None:
    assert (Path(blockkv.__file__).parent / "py.typed").is_file()


OLD_PATHS_SCRIPT = """
import importlib, json, sys, warnings
seen = {}
for old in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    seen[old] = {"module": module.__name__, "warnings": [str(w.message) for w in caught
                                                        if w.category is DeprecationWarning]}
print(json.dumps(seen))
"""


def test_every_moved_path_imports_as_the_new_module_with_a_warning() -> None:
    # a fresh interpreter, which has imported none of the old paths yet
    old_paths = sorted(moved.MOVED)
    out = subprocess.run([sys.executable, "-c", OLD_PATHS_SCRIPT, *old_paths], capture_output=True, text=True,
                         timeout=300, check=True)
    seen = json.loads(out.stdout)
    for old in old_paths:
        new = moved.MOVED[old]
        assert any(w.startswith(f"{old} is deprecated and goes in blockkv {moved.REMOVED_IN}")
                   for w in seen[old]["warnings"]), (old, seen[old])
        if new is not None:
            assert seen[old]["module"] == new, (old, seen[old])
            assert any(new in w for w in seen[old]["warnings"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module("blockkv.serving.prompt_cache") is importlib.import_module(
            "blockkv.mlx_lm.prompt_cache")


def test_an_unmoved_name_under_a_moved_package_is_not_found() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("blockkv.serving.no_such_module")
