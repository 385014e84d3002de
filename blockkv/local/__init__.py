"""One fingerprint directory's mechanisms on a local disk: its files
(``directory``), the LMDB accelerator (``index``: the tables, over the
process's shared environment, ``lmdb_env``, with entry rows packed by
``index_records``) and the in-memory catalog, the lock and writer intents,
the write and delete order (``commit``), reading an entry back (``restore``),
recovery, retention (every decision to delete), ``check`` and a read-only
``reader`` for tools."""
