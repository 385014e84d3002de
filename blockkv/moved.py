"""Old import paths of modules a layout step moved, kept for one minor version.

``import blockkv.serving.prompt_cache`` (0.1) still works in 0.2 and gives the
module at its new path, with a ``DeprecationWarning`` naming that path; 0.3
drops the old paths. A finder on ``sys.meta_path``, installed when ``blockkv``
is imported, answers only the names in ``MOVED``, so every other import is
untouched, and an old path is the very same module object as its new one
(``isinstance`` checks and patches made through either path agree).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

REMOVED_IN = "0.3"

# old path -> new path; a package that only held moved modules maps to None
MOVED: dict[str, str | None] = {
    "blockkv.serving": None,
    "blockkv.serving.prompt_cache": "blockkv.mlx_lm.prompt_cache",
    "blockkv.serving.identity": "blockkv.mlx_lm.identity",
    "blockkv.serving.cache_fit": "blockkv.mlx_lm.cache_fit",
    "blockkv.serving.portable": "blockkv.mlx_lm.cache_files",
    "blockkv.serving.warm": "blockkv.mlx_lm.warm",
    "blockkv.serving.budget": "blockkv.mlx_lm.budget",
    "blockkv.serving.demo": "blockkv.mlx_lm.demo",
    "blockkv.serving.serve": "blockkv.node.serve",
    "blockkv.serving.publish": "blockkv.node.residency_endpoint",
    "blockkv.serving.residency": "blockkv.node.journal",
    "blockkv.serving.metrics": "blockkv.node.metrics",
    "blockkv.serving.flush": "blockkv.node.flush",
    "blockkv.serving.tenants": "blockkv.node.tenants",
    "blockkv.serving.route": "blockkv.router.route",
    "blockkv.serving.scoring": "blockkv.router.scoring",
    "blockkv.serving.fleet": "blockkv.router.fleet",
    "blockkv.serving.route_tokens": "blockkv.router.route_tokens",
    "blockkv.serving.bounded_server": "blockkv.router.bounded_server",
    "blockkv.serving.digests": "blockkv.wire.residency",
    "blockkv.serving.auth": "blockkv.wire.auth",
    "blockkv.testing.model_dir": "blockkv.model_dir",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in ``MOVED`` and loads it as its new module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=MOVED[fullname] is None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        if new is None:
            where = "its modules moved to blockkv.mlx_lm, blockkv.node, blockkv.router and blockkv.wire"
        else:
            where = f"it is {new} now"
        warnings.warn(f"{spec.name} is deprecated and goes in blockkv {REMOVED_IN}: {where}",
                      DeprecationWarning, stacklevel=2)
        if new is None:
            package = types.ModuleType(spec.name)
            package.__path__ = []  # its submodules come back here, through MOVED
            return package
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new path's, already executed."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
