"""The bucket tier: one fingerprint directory in an S3-compatible bucket
(``bucket``, over its objects and requests: ``objects``), a store's uploads in
the write order (``session``), the fleet's GC and eviction (``gc``), a store's
``remote=`` tier over it (``tier``, with its ``options``, ``breaker`` and the
bucket's ``manifest``), what the tier keeps on the local disk (``files``), and
a read-only view for tools (``view``)."""
