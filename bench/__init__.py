"""fila's overhead next to the floor, measured side by side.

`.venv/bin/python -m bench` (or `bash bench/run`) runs every comparison in one process, alternating
the two sides run by run so drift hits both equally, and prints medians and ratios. See
docs/benchmarks.md for the cases, the floors and the last results.
"""
