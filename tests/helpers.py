"""Small builders shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from fila.layout import Root
from fila.models import Task


def make_root(path: Path) -> Root:
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["init", "--root", str(path)])
    assert res.exit_code == 0, res.output
    return Root.at(path)


def shell_task(command: str = "true", targets: list[str] | None = None, **kw: object) -> Task:
    return Task(engine="shell", command=command, targets=targets or ["greeting.txt"], **kw)
