"""A store's ``remote=`` tier over the bucket protocol (``bucket/``): ``tier``
(``RemoteTier``, what ``BlockStore`` sees), with its ``options`` and circuit
``breaker``; the catalog of entries only the bucket holds (``remote_catalog``),
learned from listings (``learn``, over the last one: ``listing``) and looked
up by headers (``lookup``); restoring one (``remote_restore``); uploads and the
backlog (``uploads``); and what the tier keeps on the local disk
(``files``)."""
