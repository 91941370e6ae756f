"""A queue root, a project in it, a task and its record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fila.core.layout import Root
from fila.core.models import Task

if TYPE_CHECKING:
    from fila.sandbox.fake import FakeBackend

GREETING = "hello\n"


def make_root(path: Path) -> Root:
    """`fila init` at `path` (made when missing)."""
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["init", "--root", str(path)])
    assert res.exit_code == 0, res.output
    return Root.at(path)


def make_project(path: Path, files: dict[str, str] | None = None) -> Root:
    """A queue root at `path` holding the project the shell tasks target: greeting.txt ("hello"),
    and `files` (relative path -> text) beside it."""
    root = make_root(path)
    for rel, text in {"greeting.txt": GREETING, **(files or {})}.items():
        (root.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (root.path / rel).write_text(text)
    return root


def record(root: Path | Root, tid: str) -> dict:
    """A task's record as the JSON fila wrote."""
    path = root.path if isinstance(root, Root) else root
    return json.loads((path / "fila" / "out" / f"{tid}.json").read_text())


def shell_task(command: str = "true", targets: list[str] | None = None, **kw: object) -> Task:
    return Task(engine="shell", command=command, targets=targets or ["greeting.txt"], **kw)


def fake_backend(root: Root, **kw: Any) -> FakeBackend:
    """The fake backend (no containers) with its boxes beside the queue root, not in it: recovery's
    file-level tests get an engine that answers, holds what they plant, and fails when told to."""
    from fila.sandbox.fake import FakeBackend

    return FakeBackend(root.path.parent / f"{root.path.name}.fake-boxes", **kw)
