"""blockkv for mlx-lm users: ``PersistentPromptCache``, a drop-in for mlx-lm's
``LRUPromptCache`` with this store as its disk tier (``serving/prompt_cache.py``)."""

from blockkv.serving.prompt_cache import PersistentPromptCache

__all__ = ["PersistentPromptCache"]
