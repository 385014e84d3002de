"""blockkv for mlx-lm users: ``PersistentPromptCache``, a drop-in for mlx-lm's
``LRUPromptCache`` with this store as its disk tier (``prompt_cache``), and
prompt-cache files in and out of a store (``cache_files``).

The adapter's other modules say what a model's cache is to the store: its
identity from the model's files (``identity``), the layout a restored cache
must fit (``cache_fit``), what of mlx-lm's entry a store may keep (``storable``:
a draft model's cache one token behind, image ids), a prompt's cache as mlx-lm
builds it (``warm``), the disk budget (``budget``); and the ``demo``.

The public names load on first use, so a command that needs only ``identity``
(``blockkv warm``'s argument check, ``stats``) never imports mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockkv.mlx_lm.cache_files import export_prompt_cache, import_prompt_cache
    from blockkv.mlx_lm.prompt_cache import PersistentPromptCache

__all__ = ["PersistentPromptCache", "export_prompt_cache", "import_prompt_cache"]

_HOMES = {
    "PersistentPromptCache": "blockkv.mlx_lm.prompt_cache",
    "export_prompt_cache": "blockkv.mlx_lm.cache_files",
    "import_prompt_cache": "blockkv.mlx_lm.cache_files",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'blockkv.mlx_lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
