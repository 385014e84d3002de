"""blockkv in front of mlx-lm: the drop-in prompt cache (``prompt_cache``, public
as ``blockkv.mlx_lm``), the store identity from a model's files (``identity``),
the layout a restored cache must fit (``cache_fit``), mlx-lm's server with a
disk tier (``serve``, with its ``metrics``, its disk ``budget``, its API keys:
``auth``, per-key caches: ``tenants``, the write-behind ``flush`` an export
asks for, and the residency it publishes: ``residency``, ``publish``, salted
``digests``), the router over a fleet of them (``route``, on a
``bounded_server``, its view of each node: ``fleet``, its cost model:
``scoring``, its tokens: ``route_tokens``), prompt-cache files out of and into
a store (``portable``), a prompt's cache as mlx-lm builds it (``warm``), and
the ``demo``."""
