"""One fingerprint directory's mechanisms on a local disk: its files
(``directory``), the LMDB accelerator (``index``) and the in-memory catalog,
the lock and writer intents, the write and delete order (``commit``), reading
an entry back (``restore``), recovery, retention (every decision to delete),
``check`` and a read-only ``reader`` for tools."""
