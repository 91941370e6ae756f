"""Engine adapters, imported only when chosen. An unknown name lists the valid ones."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..core.errors import UnknownEngine
from .base import Engine, Outcome

if TYPE_CHECKING:
    from ..core.models import Policy, Task
    from ..workspace.secretscan import Scanner

__all__ = ["Engine", "Outcome", "engine_names", "get_engine", "scanner_for"]

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


def scanner_for(engine: Engine, task: Task, policy: Policy) -> Scanner:
    """The scanner for every credential a run of `engine` on `task` under `policy` knows: the
    route keys, the engine's credential variables from this process's environment, the values its
    invocation marks secret. The run and recovery (which reads a dead run's work/) share it."""
    from ..workspace import secretscan

    creds = engine.credentials()[0]
    inv = engine.invocation_for(task, policy)
    return secretscan.Scanner(secretscan.known(policy, engine_vars=creds, forwarded=inv.secrets))
