"""What a ``blockkv serve`` node and ``blockkv route`` agree on: the residency
protocol's salted prefix digests (``residency``), API keys (``auth``), and the
HTTP server both run, with what a client may hold bounded (``bounded_server``
over ``shedding``)."""
