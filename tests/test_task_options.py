"""Per-engine options live under the engine (`options.<engine>`); a task file of the older form
(a top-level `command`) still reads and runs the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import InvalidTaskFile
from fila.core.layout import Root
from fila.core.models import ImageRef, Task
from fila.engines import get_engine
from tests.support.cli import fila


@pytest.fixture
def proj(root: Root) -> Path:
    """The shared queue root (conftest, no daemon), as the path this module's tests build on."""
    return root.path


def _task(**kw: Any) -> Task:
    return Task.model_validate({"engine": "shell", "targets": ["greeting.txt"], **kw})


def test_the_shell_command_under_options_and_at_the_top_level_give_the_same_invocation() -> None:
    shell = get_engine("shell")
    new = shell.invocation(_task(options={"shell": {"command": "echo hi"}}))
    old = shell.invocation(_task(command="echo hi"))
    assert new.argv == old.argv and new.argv[-1] == "echo hi"
    assert (
        shell.invocation(_task(command="echo hi", options={"shell": {"command": "echo hi"}})).argv == new.argv
    )


def test_an_option_given_twice_differently_or_unknown_to_the_engine_is_refused_by_field() -> None:
    shell = get_engine("shell")
    with pytest.raises(InvalidTaskFile) as e:
        shell.config(_task(command="a", options={"shell": {"command": "b"}}))
    assert e.value.field == "options.shell.command"
    with pytest.raises(InvalidTaskFile) as e:
        shell.config(_task(options={"shell": {"command": "a", "shell": "/bin/bash"}}))
    assert e.value.field == "options.shell.shell"
    with pytest.raises(InvalidTaskFile) as e:
        shell.config(_task(options={"shell": {"command": ""}}))
    assert e.value.field == "options.shell.command"


def test_submit_refuses_options_for_an_engine_the_task_does_not_run(proj: Path) -> None:
    ok = proj / "ok.json"
    ok.write_text(
        json.dumps(
            {"engine": "shell", "targets": ["greeting.txt"], "options": {"shell": {"command": "true"}}}
        )
    )
    res = fila(proj, "submit", str(ok))
    assert res.exit_code == 0, res.output  # the allowed counterpart
    bad = proj / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "engine": "shell",
                "targets": ["greeting.txt"],
                "options": {"shell": {"command": "true"}, "claude": {}},
            }
        )
    )
    res = fila(proj, "submit", str(bad))
    assert res.exit_code == 2 and "options.claude" in res.output, res.output


@pytest.mark.docker
def test_a_task_with_options_runs_through_the_cycle_like_the_older_form(
    proj: Path, shell_image: ImageRef
) -> None:
    for tid, extra in (
        ("new", {"options": {"shell": {"command": "echo new > greeting.txt"}}}),
        ("old", {"command": "echo old > greeting.txt"}),
    ):
        f = proj / f"{tid}.json"
        f.write_text(json.dumps({"id": tid, "engine": "shell", "targets": ["greeting.txt"], **extra}))
        assert fila(proj, "submit", str(f)).exit_code == 0
    res = fila(proj, "run", "--once")
    assert res.exit_code == 0, res.output
    for tid in ("new", "old"):
        rec = json.loads((proj / "fila" / "out" / f"{tid}.json").read_text())
        assert rec["status"] == "needs_review", rec
        assert f"+{tid}" in (proj / rec["patch_path"]).read_text()
