"""``ReadOnlyStore``: find and restore from a root this process cannot (or
must not) write: a read-only mount, a snapshot, another user's cache.

A ``BlockStore`` creates the root, takes the directory lock, keeps the LMDB
index current and records last use, so it needs write access. This opens
nothing for writing: it lists the directory the way ``blockkv ls`` does
(``reader.read_directory``: the files are the truth, a trusted index is read
creating no file, its lock taken shared) and restores through the same verified reads as a store.
It never deletes: a corrupt header or block is a miss with a warning, left for
a writer's ``check --repair``. ``refresh()`` sees what writers changed since.
It serves the identity's entries of both modes (stored with or without
``isolate_namespaces``, as ``ls`` lists them): a reader of the files is no
tenant, and each entry's blocks are read under the key its header names.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from blockkv.arguments import check_ns, check_prefix_len, tokens_array
from blockkv.format.blocks import CODEC_ID
from blockkv.format.header import Identity
from blockkv.format.layout import fingerprint_dirname
from blockkv.fs import FileLayer
from blockkv.local.catalog import Catalog
from blockkv.local.directory import Directory, read_identity
from blockkv.local.executors import core_threads
from blockkv.local.reader import read_directory
from blockkv.local.restore import EntryRead
from blockkv.records import Entry, Loaded, Match

log = logging.getLogger("blockkv")


class ReadOnlyStore:
    """``find``/``find_exact``/``restore`` of a ``BlockStore`` over a root it
    only reads. Safe beside writers in other processes (a file they remove
    while it reads is a miss)."""

    def __init__(self, root: str | os.PathLike[str], *, model_id: str, config_fingerprint: str,
                 tokenizer_hash: str, verify: bool | str = True) -> None:
        self.root = Path(root).expanduser()
        self.identity = Identity(model_id, config_fingerprint, tokenizer_hash, CODEC_ID)
        self.directory = self.root / fingerprint_dirname(config_fingerprint)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no store for {config_fingerprint!r} in {self.root}")
        self.verify = verify
        self._dir = Directory(self.directory, self.identity, FileLayer())
        self._catalog = Catalog(self._dir.modes, time.time)
        self._owners: dict[str, str] = {}  # entry id -> its header's identity digest (its mode)
        self._io = ThreadPoolExecutor(core_threads(), thread_name_prefix="blockkv-read")
        self.refresh()

    @classmethod
    def open_dir(cls, directory: str | os.PathLike[str], **kwargs: bool | str) -> ReadOnlyStore:
        """A fingerprint directory, with the identity its ``IDENTITY`` file records."""
        d = Path(directory).expanduser()
        ident = read_identity(d)
        return cls(d.parent, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                   tokenizer_hash=ident.tokenizer_hash, **kwargs)

    def __repr__(self) -> str:
        return f"<ReadOnlyStore {str(self.root)!r} model_id={self.identity.model_id!r}>"

    def refresh(self) -> int:
        """List the directory again; returns the entries it serves."""
        view = read_directory(self.directory)
        last_use = {e.id: e.last_use for e in view.entries}
        catalog = Catalog(self._dir.modes, time.time)
        for record in view.records:
            catalog.add(record, last_use.get(record.id, 0.0), view.block_sizes)
        self._catalog, self._owners = catalog, {r.id: r.owner for r in view.records}
        return len(catalog)

    def close(self) -> None:
        self._io.shutdown()

    def __enter__(self) -> ReadOnlyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._catalog)

    def entries(self, ns: str | None = None) -> list[Entry]:
        return self._catalog.entries(ns)

    def find(self, prompt: Sequence[int], ns: str = "") -> Match | None:
        check_ns(ns)
        return self._catalog.find(tokens_array(prompt), ns)

    def find_exact(self, tokens: Sequence[int], ns: str = "") -> Match | None:
        check_ns(ns)
        return self._catalog.find_exact(tokens_array(tokens), ns)

    def restore(self, entry: Entry, prefix_len: int | None = None) -> Loaded | None:
        """The entry's caches (cut to ``prefix_len``), or None with a warning:
        nothing is deleted or marked, whatever the read finds."""
        if not isinstance(entry, Entry):
            raise TypeError(f"restore takes an Entry from find/find_exact, got {type(entry).__name__}")
        p = check_prefix_len(entry, prefix_len)
        mode = self._dir.modes.get(self._owners.get(entry.id, ""), self.identity)
        read = EntryRead(self._dir, mode, entry, self.verify, self._io)
        try:
            header, caches, attachments = read.run(None if p == entry.length else p)
        except Exception as exc:  # noqa: BLE001 - a read-only restore is a miss, never an error
            log.warning("blockkv: restore of entry %s from %s failed (%r): a miss", entry.id, self.directory, exc)
            return None
        return Loaded(caches, tuple(header.tokens[:p].tolist()), attachments, entry.checkpoint)
