"""blockkv for mlx-lm users: ``PersistentPromptCache``, a drop-in for mlx-lm's
``LRUPromptCache`` with this store as its disk tier (``serving/prompt_cache.py``),
and prompt-cache files in and out of a store (``serving/portable.py``)."""

from blockkv.serving.portable import export_prompt_cache, import_prompt_cache
from blockkv.serving.prompt_cache import PersistentPromptCache

__all__ = ["PersistentPromptCache", "export_prompt_cache", "import_prompt_cache"]
