"""Small builders shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fila.core.layout import Root
from fila.core.models import Task

if TYPE_CHECKING:
    from fila.sandbox.fake import FakeBackend


def make_root(path: Path) -> Root:
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["init", "--root", str(path)])
    assert res.exit_code == 0, res.output
    return Root.at(path)


def fila(root: Path, *args: str, env: dict[str, str] | None = None, input: str | None = None):
    """The CLI in-process (typer's CliRunner), on the queue root `root`."""
    from typer.testing import CliRunner

    from fila.cli import app

    return CliRunner().invoke(app, [*args, "--root", str(root)], env=env, input=input)


def submit_shell(root: Path, command: str, *targets: str, extra: tuple[str, ...] = ()) -> str:
    """Submit a shell task through the CLI and return its id."""
    args = ["submit", "--engine", "shell", "--command", command, *extra]
    for t in targets or ("greeting.txt",):
        args += ["--target", t]
    res = fila(root, *args)
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def record(root: Path, tid: str) -> dict:
    import json

    return json.loads((root / "fila" / "out" / f"{tid}.json").read_text())


def shell_task(command: str = "true", targets: list[str] | None = None, **kw: object) -> Task:
    return Task(engine="shell", command=command, targets=targets or ["greeting.txt"], **kw)


def fake_backend(root: Root, **kw: Any) -> FakeBackend:
    """The fake backend (no containers) with its boxes beside the queue root, not in it: recovery's
    file-level tests get an engine that answers, holds what they plant, and fails when told to."""
    from fila.sandbox.fake import FakeBackend

    return FakeBackend(root.path.parent / f"{root.path.name}.fake-boxes", **kw)


def quick_for(values: Iterable[Any], *quick: Any) -> list[Any]:
    """Parametrize values with the `quick` mark on the chosen ones: the quick tier
    (`scripts/test --quick`) runs those cases of a test that runs every value in the full suite."""
    chosen = set(quick)
    missing = chosen - set(values)
    assert not missing, f"quick_for: {sorted(missing)} are not among the values"
    return [pytest.param(v, marks=pytest.mark.quick) if v in chosen else v for v in values]
