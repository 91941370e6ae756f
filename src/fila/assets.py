"""Files fila ships beside its code: policies/ and images/ (top level of the repository).

A wheel carries them as `fila/_shipped/` (see pyproject's force-include); a source checkout or an
editable install reads them from the repository's top level, so there is one copy of each.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """Directory of shipped `policies` or `images`."""
    for candidate in (_PKG / "_shipped" / name, _PKG.parents[1] / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"fila's shipped '{name}' directory is missing from {_PKG}")
