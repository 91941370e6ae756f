"""Engine adapters, imported only when chosen. An unknown name lists the valid ones."""

from __future__ import annotations

import importlib

from ..core.errors import UnknownEngine
from .base import Engine, Outcome

__all__ = ["Engine", "Outcome", "engine_names", "get_engine"]

# name -> "module:Class"; an adapter's module is imported only when a task names it.
_ENGINES = {
    "shell": "fila.engines.shell:ShellEngine",
    "claude": "fila.engines.claude:ClaudeEngine",
    "codex": "fila.engines.codex:CodexEngine",
    "opencode": "fila.engines.opencode:OpencodeEngine",
    "gemini": "fila.engines.gemini:GeminiEngine",
    "qwen": "fila.engines.qwen:QwenEngine",
    "aider": "fila.engines.aider:AiderEngine",
}


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def get_engine(name: str) -> Engine:
    try:
        target = _ENGINES[name]
    except KeyError:
        raise UnknownEngine(
            f"unknown engine {name!r}",
            hint=f"valid engines: {', '.join(engine_names())}",
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()
