"""What is on disk, with no file system: mlx-lm caches as records (``codec``),
records as content-addressed blocks and their frame (``blocks``), the header
file (``header``), and the unfilled arrays a restore reads into (``unfilled``)."""
