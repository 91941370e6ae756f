"""Each engine on any environment (docs/environments.md, "Engines on an environment"): the
engine's CLI and its own runtime copied from its image into a layer on top of the environment's,
under a prefix of its own on PATH first, so the project's `node` and `python` stay the project's.
The shell engine runs on the environment's image itself: its `sh` is the project's.

Built once per (environment, engine image), tagged `fila/env-<engine>:<key>` and labelled with both
ids (a changed engine image makes a new layer); every engine's `--version` on such layers is
proven by tests/test_env_run.py, not at run time: a layer that does not start fails its task.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ImageMissing, InvalidInput
from ..core.models import ImageRef
from ..sandbox.base import Backend
from .build import KEY_LABEL, LABEL

PREFIX = "/opt/fila"
ENGINE_IMAGE_LABEL = "fila.env.engine.image"
_STANDARD_PATH = {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}


@dataclass(frozen=True)
class Layout:
    """What of an engine's image makes its CLI: (source in the engine image, destination) pairs,
    launchers written into PREFIX/bin (a script run by the engine's own runtime, never by
    whatever `node` the project has), and the version command."""

    copies: tuple[tuple[str, str], ...]
    launchers: tuple[tuple[str, str], ...] = ()
    path: tuple[str, ...] = ()


def _node_cli(name: str, package: str, entry: str) -> Layout:
    node = f"{PREFIX}/{name}/node"
    return Layout(
        copies=(("/usr/local/bin/node", node), (package, package)),
        launchers=((name, f'#!/bin/sh\nexec {node} {package}/{entry} "$@"\n'),),
    )


AIDER_PYTHON = "/opt/aider/bin/python3 -I -B -u"

LAYOUTS: dict[str, Layout] = {
    "claude": Layout(copies=(("/usr/local/bin/claude", f"{PREFIX}/bin/claude"),)),
    "opencode": Layout(copies=(("/usr/local/bin/opencode", f"{PREFIX}/bin/opencode"),)),
    "codex": Layout(copies=(("/opt/codex", "/opt/codex"),), path=("/opt/codex/codex-path", "/opt/codex/bin")),
    "gemini": _node_cli("gemini", "/opt/gemini", "bundle/gemini.js"),
    "qwen": _node_cli("qwen", "/opt/qwen", "cli-entry.js"),
    # aider's prefix holds its venv, its Python and every library they load (images/aider): only
    # `aider` goes on PATH (the prefix's bin/ has a `python3`). -I: the project's PYTHONPATH,
    # PYTHONHOME and user site never reach aider's Python (-B -u stand for the image's
    # PYTHONDONTWRITEBYTECODE and PYTHONUNBUFFERED, which -I ignores). GitPython without a `git`
    # on PATH stays quiet; aider runs with --no-git.
    "aider": Layout(
        copies=(("/opt/aider", "/opt/aider"),),
        launchers=(
            ("aider", f'#!/bin/sh\nGIT_PYTHON_REFRESH=quiet exec {AIDER_PYTHON} /opt/aider/bin/aider "$@"\n'),
        ),
    ),
}


def tag_for(engine: str, key: str) -> str:
    return f"fila/env-{engine}:{key[:32]}"


def layer(
    backend: Backend,
    engine: str,
    env_image: ImageRef,
    key: str,
    engine_image: str,
    *,
    progress: Callable[[str], None] = lambda _m: None,
) -> ImageRef:
    """The engine's image on the environment `env_image` (built when missing or stale)."""
    if engine == "shell":
        return env_image
    layout = LAYOUTS.get(engine)
    if layout is None:
        raise InvalidInput(f"engine {engine!r} has no layout for project environments")
    eng = backend.image_info(engine_image)
    if eng is None:
        raise ImageMissing(f"image {engine_image} is not built", hint=f"run `fila images build {engine}`")
    tag = tag_for(engine, key)
    have = backend.image_info(tag)
    if (
        have is not None
        and have.labels.get(ENGINE_IMAGE_LABEL) == eng.id
        and have.labels.get(KEY_LABEL) == key
    ):
        return ImageRef(tag=tag, id=have.id)
    progress(f"environment {key[:12]}: adding {engine} ({engine_image})")
    env_info = backend.image_info(env_image.id or env_image.tag)
    env_path = _path_of(env_info.env if env_info else [])
    extra = [e for e in eng.env if not e.startswith(("PATH=", "HOME="))]
    engine_path = [p for p in _path_of(eng.env).split(":") if p and p not in _STANDARD_PATH]
    path = ":".join([f"{PREFIX}/bin", *layout.path, *engine_path, env_path])
    lines = [f"FROM {env_image.id or env_image.tag}"]
    lines += [f"COPY --from={engine_image} {src} {dst}" for src, dst in layout.copies]
    for name, _body in layout.launchers:
        lines.append(f"COPY {name} {PREFIX}/bin/{name}")
    env = [*extra, f"PATH={path}"]
    lines.append("ENV " + " ".join(_quoted(e) for e in env))
    with tempfile.TemporaryDirectory(prefix="fila-env-engine-") as tmp:
        for name, body in layout.launchers:
            (Path(tmp) / name).write_text(body)
            (Path(tmp) / name).chmod(0o755)
        (Path(tmp) / "Dockerfile").write_text("\n".join(lines) + "\n")
        backend.build_context(
            Path(tmp),
            tag,
            buildargs={},
            labels={LABEL: "engine", KEY_LABEL: key, ENGINE_IMAGE_LABEL: eng.id, "fila.engine": engine},
            nocache=False,
            progress=lambda _line: None,
            network="none",
        )
    built = backend.image_info(tag)
    if built is None:
        raise ImageMissing(f"building {tag} left no image")
    return ImageRef(tag=tag, id=built.id)


def _path_of(env: list[str]) -> str:
    for e in env:
        if e.startswith("PATH="):
            return e[5:]
    return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _quoted(assignment: str) -> str:
    import json

    name, _, value = assignment.partition("=")
    return f"{name}={json.dumps(value)}"
