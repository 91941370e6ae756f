"""`python -m fila`: the same as the `fila` console script."""

from .entry import main

main()
