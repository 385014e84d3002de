"""What is on disk, with no file system: mlx-lm caches as records (``codec``,
the built-in cache ``kinds``), records as content-addressed blocks and their
frame (``blocks``), the header file (``header``), and the unfilled arrays a
restore reads into (``unfilled``)."""

from blockkv.format import kinds  # noqa: F401 - registers the built-in cache kinds
