"""Bad input gets a clear error and loses nothing (no Docker needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fila.cli import app
from fila.core.layout import Root
from tests.support.cli import fila
from tests.support.project import make_project


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    return make_project(tmp_path, {"src/a.py": "print('hello')\n", ".env": "SECRET=1\n"}).path


def test_submit_with_options_prints_the_id(proj: Path) -> None:
    res = fila(proj, "submit", "--engine", "shell", "--command", "true", "--target", "greeting.txt")
    assert res.exit_code == 0, res.output
    tid = res.stdout.strip()
    assert (proj / "fila" / "in" / f"{tid}.json").exists()
    assert json.loads((proj / "fila" / "out" / f"{tid}.json").read_text())["status"] == "queued"


def test_submit_task_file_and_stdin(proj: Path) -> None:
    task = {"id": "from-file", "engine": "shell", "command": "true", "targets": ["src"]}
    f = proj / "task.json"
    f.write_text(json.dumps(task))
    assert fila(proj, "submit", str(f)).stdout.strip() == "from-file"
    task["id"] = "from-stdin"
    res = fila(proj, "submit", "-", "--json", input=json.dumps(task))
    assert json.loads(res.stdout) == {"id": "from-stdin", "status": "queued"}


def test_malformed_json_is_refused_with_exit_2(proj: Path) -> None:
    f = proj / "bad.json"
    f.write_text('{"engine": "shell",')
    res = fila(proj, "submit", str(f))
    assert res.exit_code == 2
    assert "malformed JSON" in res.stderr and "bad.json" in res.stderr


def test_schema_violation_names_the_field(proj: Path) -> None:
    f = proj / "bad.json"
    f.write_text(json.dumps({"engine": "shell", "command": "x", "targets": ["a"], "timeout": "10"}))
    res = fila(proj, "submit", str(f))
    assert res.exit_code == 2 and "field 'timeout'" in res.stderr
    f.write_text(json.dumps({"engine": "shell", "command": "x", "targets": ["a"], "colour": 1}))
    res = fila(proj, "submit", str(f))
    assert res.exit_code == 2 and "colour" in res.stderr


def test_unknown_engine_lists_the_valid_ones(proj: Path) -> None:
    res = fila(proj, "submit", "--engine", "gpt9", "--target", "greeting.txt")
    assert res.exit_code == 2
    assert "unknown engine 'gpt9'" in res.stderr and "shell" in res.stderr


def test_shell_engine_needs_a_command(proj: Path) -> None:
    res = fila(proj, "submit", "--engine", "shell", "--target", "greeting.txt")
    assert res.exit_code == 2 and "command" in res.stderr


def test_unknown_policy_lists_the_existing_ones(proj: Path) -> None:
    res = fila(
        proj, "submit", "--engine", "shell", "--command", "true", "-t", "greeting.txt", "--policy", "nope"
    )
    assert res.exit_code == 2 and "unknown policy 'nope'" in res.stderr and "default" in res.stderr


def test_timeout_above_the_cap_is_refused_not_clipped(proj: Path) -> None:
    res = fila(
        proj,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "-t",
        "greeting.txt",
        "--timeout",
        str(10**9),
    )
    assert res.exit_code == 2 and "above the cap" in res.stderr
    assert not list((proj / "fila" / "in").glob("*.json"))


def test_limits_may_narrow_but_not_widen(proj: Path) -> None:
    base = {"engine": "shell", "command": "true", "targets": ["greeting.txt"]}
    f = proj / "t.json"
    f.write_text(json.dumps({**base, "limits": {"memory": "64g"}}))
    res = fila(proj, "submit", str(f))
    assert res.exit_code == 2 and "memory" in res.stderr
    f.write_text(json.dumps({**base, "limits": {"memory": "128m", "cpus": 0.5}}))
    assert fila(proj, "submit", str(f)).exit_code == 0


@pytest.mark.parametrize(
    ("target", "expect"),
    [
        ("missing.txt", "does not exist"),
        ("/etc/passwd", "outside the project"),
        ("../x", "outside the project"),
        ("src/../../x", "outside the project"),
        ("out-link", "symlink pointing outside"),
        (".env", "deny rule"),
        (".git/config", ".git"),
        ("fila/in", "fila's own"),
    ],
)
def test_bad_targets_are_refused_clearly(proj: Path, target: str, expect: str) -> None:
    os.symlink("/etc", proj / "out-link")
    (proj / ".git").mkdir()
    (proj / ".git" / "config").write_text("")
    res = fila(proj, "submit", "--engine", "shell", "--command", "true", "--target", target)
    assert res.exit_code == 2, res.output
    assert expect in res.stderr


def test_duplicate_id_exits_4(proj: Path) -> None:
    args = ["submit", "--engine", "shell", "--command", "true", "-t", "greeting.txt", "--id", "x1"]
    assert fila(proj, *args).exit_code == 0
    res = fila(proj, *args)
    assert res.exit_code == 4 and "exists already" in res.stderr


def test_schema_prints_the_published_schemas() -> None:
    for kind in ("task", "policy", "record", "environment"):
        res = CliRunner().invoke(app, ["schema", kind])
        assert res.exit_code == 0
        assert "properties" in json.loads(res.stdout)
    assert CliRunner().invoke(app, ["schema", "nope"]).exit_code == 2


def test_published_schema_files_match_the_models() -> None:
    from fila.core.models import schema_for

    here = Path(__file__).resolve().parents[1] / "schemas"
    for kind in ("task", "policy", "record"):
        assert json.loads((here / f"{kind}.schema.json").read_text()) == schema_for(kind), (
            f"schemas/{kind}.schema.json is stale: regenerate with `fila schema {kind}`"
        )
    from fila.env.spec import EnvSpec

    assert json.loads((here / "environment.schema.json").read_text()) == EnvSpec.model_json_schema(), (
        "schemas/environment.schema.json is stale: regenerate with `fila schema environment`"
    )


def test_every_shipped_policy_loads() -> None:
    from fila.assets import shipped_dir
    from fila.queue.policy import load_policy

    shipped = sorted(p.stem for p in shipped_dir("policies").glob("*.json"))
    # The glob found the shipped policies (an empty one would prove nothing): at least the default.
    assert "default" in shipped, shipped
    for name in shipped:
        load_policy(Root.at(shipped_dir("policies").parent), name)


def test_show_unknown_task_exits_5(proj: Path) -> None:
    res = fila(proj, "show", "nope")
    assert res.exit_code == 5 and "no task" in res.stderr


def test_commands_outside_a_queue_root_say_so(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["ls", "--root", str(tmp_path)])
    assert res.exit_code == 1 and "fila init" in res.stderr
