"""blockkv in front of mlx-lm: the drop-in prompt cache (``prompt_cache``, public
as ``blockkv.mlx_lm``), the store identity from a model's files (``identity``),
mlx-lm's server with a disk tier (``serve``), the ``demo``."""
