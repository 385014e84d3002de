"""The measured concerns of ``tools/bench.py``, one module each; ``tools/bench.py``
is the one entry point: it runs them in order and writes the report."""
