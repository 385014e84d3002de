"""``python -m blockkv``: the same entry point as the ``blockkv`` console script,
for environments where the script is not on PATH."""

from blockkv.cli import main

raise SystemExit(main())
