"""The bucket protocol: one fingerprint directory in an S3-compatible bucket,
shared by a fleet of nodes, beside ``local/`` (neither imports the other).

``bucket`` is the facade a store and the tools call, over ``bucket_dir`` (the
directory's pools, settings and bounded, verified reads) and ``objects`` (the
pools whose listings carry size and server time; what counts as an outage);
``session`` writes a store in the write order; ``gc`` and ``evict`` are the
fleet's mark-and-sweep and LRU; ``fetch``, ``bucket_verdicts`` and ``heal`` are proof
and what a node does with it; ``clock`` checks the server's clock;
``fleet_key`` seals what a fleet writes; ``manifest`` packs every header in
one object; ``bucket_reader`` and ``bucket_check`` are the tools' read-only look and
``check --remote``. The names of it all are ``format/layout.py``'s."""
