"""Container engines fila runs jobs on, behind one interface (base.Backend).

`get_backend(name)` imports a backend's module only when it is chosen (the Docker SDK is not
loaded by commands that never talk to an engine). The name comes from FILA_BACKEND, else the
caller (a queue root's config), else Docker. `fake` (sandbox/fake.py: no containers, not a
sandbox) is chosen only by FILA_BACKEND, never by a queue root's config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import InvalidInput
from .base import Backend, Box, RunResult, RunSpec

if TYPE_CHECKING:
    from ..core.layout import Root

__all__ = [
    "BACKENDS",
    "Backend",
    "Box",
    "RunResult",
    "RunSpec",
    "backend_name",
    "get_backend",
    "root_backend",
]

ENV = "FILA_BACKEND"
DEFAULT = "docker"


def _docker() -> Backend:
    from .docker.backend import DockerBackend

    return DockerBackend()


def _podman() -> Backend:
    from .podman.backend import PodmanBackend

    return PodmanBackend()


def _fake() -> Backend:
    from .fake import FakeBackend

    return FakeBackend()


BACKENDS: dict[str, Callable[[], Backend]] = {"docker": _docker, "podman": _podman, "fake": _fake}
# Not a sandbox: only FILA_BACKEND (one command's explicit choice) names it, never a queue root.
EXPLICIT_ONLY = frozenset({"fake"})
SANDBOXES = sorted(set(BACKENDS) - EXPLICIT_ONLY)


def config_path(root: Root) -> Path:
    return root.fila / "config.json"


def root_backend(root: Root) -> str | None:
    """The backend a queue root names in fila/config.json (`fila init --backend`), if any."""
    path = config_path(root)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InvalidInput(f"cannot read the queue root's config: {e}", path=path) from e
    name = data.get("backend") if isinstance(data, dict) else None
    if name is not None and not isinstance(name, str):
        raise InvalidInput("field 'backend' must be a string", path=path, field="backend")
    return name


def check_name(name: str) -> str:
    """A backend name, normalised; an unknown one lists the valid ones (exit 2)."""
    norm = name.strip().lower()
    if norm in EXPLICIT_ONLY:
        raise InvalidInput(
            f"field 'backend': the {norm} backend is not a sandbox and is never a queue root's backend",
            hint=f"valid backends: {', '.join(SANDBOXES)}; FILA_BACKEND={norm} chooses it for one command",
        )
    if norm not in BACKENDS:
        raise InvalidInput(
            f"field 'backend': unknown container backend {name!r}",
            hint=f"valid backends: {', '.join(SANDBOXES)}",
        )
    return norm


def set_root_backend(root: Root, name: str) -> None:
    """Name the root's backend in fila/config.json."""
    from ..core.fsutil import atomic_write

    path = config_path(root)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        data = {}
    data["backend"] = check_name(name)
    atomic_write(path, json.dumps(data, indent=1) + "\n")


def backend_name(configured: str | None = None) -> str:
    """The chosen backend's name: FILA_BACKEND when set (this command's choice), else the queue
    root's setting, else docker."""
    env = os.environ.get(ENV)
    if not env and configured is not None and configured.strip().lower() in EXPLICIT_ONLY:
        check_name(configured)  # refused: a root's config never names a backend that is no sandbox
    name = (env or configured or DEFAULT).strip().lower()
    if name not in BACKENDS:
        source = ENV if env else "the queue root's fila/config.json field 'backend'"
        raise InvalidInput(
            f"{source}: unknown container backend {name!r}",
            hint=f"valid backends: {', '.join(sorted(BACKENDS))}",
        )
    return name


def get_backend(name: str | None = None) -> Backend:
    """A new backend of that name (see backend_name); nothing connects until it is used."""
    return BACKENDS[backend_name(name)]()
