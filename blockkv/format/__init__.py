"""What is on disk, with no file system: mlx-lm caches as records (``codec``,
the built-in cache ``kinds``), records cut into content-addressed blocks
(``blocks``), the descriptor that lists an entry's blocks (``descriptor``), a
block's frame (``frame``), caches rebuilt from blocks (``rebuild``), the header
file (``header``), the unfilled arrays a restore reads into (``unfilled``),
mlx-lm's cache state protocol in each version (``state_api``), and every
name and path the disk and the bucket share (``layout``)."""

from blockkv.format import kinds  # noqa: F401 - registers the built-in cache kinds
