"""One fingerprint directory's mechanisms on a local disk, beside ``bucket/``
(neither imports the other): its files (``directory``), the LMDB accelerator
(``index``: the tables, over the process's shared environment, ``lmdb_env``,
with entry rows packed by ``index_records``, kept by ``index_keeper``, its
transactions' lock ``txn_lock``), the in-memory ``catalog`` over a
``prefix_index``, the directory lock (``locks``) and writer
intents (``writers``), a handle's threads (``executors``), the write and
delete order (``commit``), reading an entry back (``restore``; as the
store's first tier: ``disk_tier``), keeping what a restore fetched from the
bucket (``adoptions``), ``recovery``, ``retention`` (every decision to
delete, with what a failed read proves: ``verdicts``), ``directory_check``,
for tools a read-only ``reader`` and ``read_only`` store, and a store
handle's pieces built in one direction (``handle``)."""
