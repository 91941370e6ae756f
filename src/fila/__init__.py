"""fila: AI coding engines in throwaway hardened containers, stopped at a review gate.

`from fila import Client` is the typed API (docs/api.md); it is imported on first use, so the
console script's `fila --help` loads nothing more (docs/architecture.md, start-up cost)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api.client import Client

__all__ = ["Client"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .api.client import Client

        return Client
    raise AttributeError(f"module 'fila' has no attribute {name!r}")
