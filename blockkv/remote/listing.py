"""What one store handle knows of the headers in its bucket directory, shared
by the tier's learning (learn.py), restores (tier.py) and uploads (uploads.py):
the last listing, the headers not to learn, and those that leave a block's
key in doubt (bucket_verdicts.py's "vouched")."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from blockkv.bucket.objects import ObjectInfo


class Listing:
    """Thread-safe: one lock guards the three sets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._listed: dict[str, ObjectInfo] = {}  # headers in the bucket at the last listing (plus our uploads)
        self._ignored: set[str] = set()  # headers not to learn: damaged, unsealed, another identity, a checkpoint
        self._unsure: set[str] = set()  # listed headers that name blocks with a key, or do not read

    def replace(self, listed: Mapping[str, ObjectInfo]) -> None:
        """A new listing: what left the bucket needs no remembering."""
        with self.lock:
            self._listed = dict(listed)
            self._ignored &= set(listed)
            self._unsure &= set(listed)

    def get(self, name: str) -> ObjectInfo | None:
        return self._listed.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._listed

    def landed(self, name: str, info: ObjectInfo) -> None:
        """A header this handle uploaded."""
        with self.lock:
            self._listed[name] = info

    def take(self, names: Iterable[str]) -> list[str]:
        """Forget ``names`` as listed (their headers are about to be deleted); those that were."""
        with self.lock:
            return [n for n in names if self._listed.pop(n, None) is not None]

    def ignored(self) -> set[str]:
        with self.lock:
            return set(self._ignored)

    def ignore(self, names: Iterable[str]) -> None:
        with self.lock:
            self._ignored.update(names)

    def doubt(self, names: Iterable[str]) -> None:
        """Headers that name blocks with a key, or do not read: while any is
        listed, an unkeyed block's key is not known for sure."""
        with self.lock:
            self._unsure.update(names)

    def vouches(self, sealed: bool, key: bytes | None) -> bool:
        """Is the key a header's blocks were named with known for sure (bucket_verdicts.py)?
        Sealed with the fleet key; or unkeyed, in a directory where every listed
        header reads and none names blocks with a key (so none can be another
        key's block that a lying header claims)."""
        with self.lock:
            return sealed or (key is None and not self._unsure)
