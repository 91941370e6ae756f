"""Start-up: the console script and the lazily built CLI answer exactly as typer's eager build does,
and a command imports only what it uses (no timings here: bench/ci_single.py measures them)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import typer.main

from fila import entry
from fila.cli import app, lazy_command

from .helpers import make_root

FILA = Path(sys.executable).parent / "fila"


def _run(group: Any, args: list[str], width: int = 78) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a click group in this process, as `fila ARGS` would give."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = group.main(args, prog_name="fila", standalone_mode=False, terminal_width=width)
        except Exception as e:  # a usage error: printed as standalone mode would
            from typer._click.exceptions import ClickException

            if not isinstance(e, ClickException):
                raise
            e.show()
            code = e.exit_code
    return code, out.getvalue(), err.getvalue()


def _eager() -> Any:
    return typer.main.get_command(app)


def _every_command_path() -> list[list[str]]:
    eager = _eager()
    paths: list[list[str]] = []
    for name, cmd in eager.commands.items():
        paths.append([name])
        paths += [[name, sub] for sub in getattr(cmd, "commands", {})]
    return paths


def test_every_command_path_is_listed() -> None:
    # The comparisons below walk this list: it holds the top-level commands and `images build`.
    paths = _every_command_path()
    assert ["submit"] in paths and ["images", "build"] in paths and len(paths) > 20


@pytest.mark.parametrize("width", [78, 50, 120])
@pytest.mark.parametrize("args", [["--help"], [], ["images", "--help"], ["images"]])
def test_group_help_is_typers_own(args: list[str], width: int) -> None:
    lazy = _run(lazy_command(app), args, width)
    assert lazy == _run(_eager(), args, width)
    assert "Commands:" in lazy[1] + lazy[2]


def test_every_commands_help_is_typers_own() -> None:
    for path in _every_command_path():
        lazy = _run(lazy_command(app), [*path, "--help"])
        eager = _run(_eager(), [*path, "--help"])
        assert lazy == eager, path
        assert lazy[0] == 0 and "Usage: fila " + " ".join(path) in lazy[1], path


def test_lazily_built_commands_have_typers_parameters() -> None:
    """The command a process runs is built by typer's own function: the same options, types,
    defaults, envvars and help as in typer's eager build."""

    def params(cmd: Any) -> list[tuple[Any, ...]]:
        return [
            (p.name, tuple(p.opts), tuple(p.secondary_opts), p.required, repr(p.default), p.multiple,
             p.nargs, p.envvar, getattr(p, "help", None), p.type_descriptor.annotation)
            for p in cmd.params
        ]  # fmt: skip

    lazy, eager = lazy_command(app), _eager()
    for path in _every_command_path():
        a, b = lazy, eager
        for name in path:
            a, b = a.commands[name], b.commands[name]
        assert params(a) == params(b), path
        assert (a.help, a.short_help, a.hidden, a.name) == (b.help, b.short_help, b.hidden, b.name), path


@pytest.mark.parametrize(
    "args",
    [
        ["sbumit"],  # a typo: typer's suggestion
        ["submit", "--no-such-option"],
        ["show"],  # a missing argument
        ["run", "--concurrency", "0"],  # a value out of range
        ["images", "biuld"],
    ],
)
def test_usage_errors_are_typers_own(args: list[str]) -> None:
    lazy = _run(lazy_command(app), args)
    assert lazy == _run(_eager(), args)
    assert lazy[0] == 2 and "Error" in lazy[2], lazy


def test_lazy_group_builds_only_the_command_it_runs() -> None:
    group = lazy_command(app)
    _run(group, ["--help"])
    assert group.commands._built.keys() <= {"images"}  # the listing used summaries
    _run(group, ["schema", "--help"])
    assert set(group.commands._built) <= {"images", "schema"}


def test_stored_help_is_what_typer_prints_for_the_current_cli() -> None:
    from fila import _help

    assert entry.cli_sha256() == _help.CLI_SHA256, (
        "fila/cli.py changed since fila/_help.py was written: regenerate it with "
        "`.venv/bin/python -m fila.entry --write-help`"
    )
    assert _help.TEXT == entry.render_help() == _run(_eager(), ["--help"])[1]


def _console(args: list[str], env: dict[str, str] | None = None, argv0: str | None = None) -> Any:
    """The console script in a fresh process, with the modules it imported on stderr's last line."""
    code = (
        "import sys, atexit, json\n"
        "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules))))\n"
        f"sys.argv = [{argv0 or str(FILA)!r}, *{args!r}]\n"
        "from fila.entry import main\n"
        "main()\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **(env or {})}
    )
    err, _, mods = p.stderr.rpartition("\nMODULES ")
    return p.returncode, p.stdout, err, set(json.loads(mods))


def test_console_help_is_the_clis_help_and_imports_no_typer() -> None:
    code, out, _err, mods = _console(["--help"])
    assert code == 0 and out == _run(_eager(), ["--help"])[1]
    assert "typer" not in mods and "fila.cli" not in mods and "pydantic" not in mods
    # Where typer would wrap differently, typer answers, and it prints what the stored text says
    # for 80 columns and more.
    code, narrow, _err, mods = _console(["--help"], env={"COLUMNS": "60"})
    assert code == 0 and "fila.cli" in mods and narrow == _run(_eager(), ["--help"], 58)[1]
    assert narrow != out
    code, wide, _err, mods = _console(["--help"], env={"COLUMNS": "200"})
    assert wide == out and "fila.cli" not in mods


def test_console_passes_everything_else_to_the_cli(tmp_path: Path) -> None:
    # Another program name, a command's help, no argument: the CLI answers, as typer would.
    code, out, _err, mods = _console(["--help"], argv0="/usr/local/bin/fila-dev")
    assert code == 0 and "fila.cli" in mods and out.startswith("Usage: fila-dev ")
    code, out, _err, mods = _console(["submit", "--help"])
    assert code == 0 and out == _run(_eager(), ["submit", "--help"])[1]
    code, out, err, _mods = _console([])
    eager = _run(_eager(), [])
    assert (code, out, err.rstrip("\n")) == (eager[0], eager[1], eager[2].rstrip("\n"))


def test_console_submit_imports_no_container_client(tmp_path: Path) -> None:
    """`fila submit` checks and queues a task: no Docker SDK, HTTP stack or worker is loaded."""
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    args = ["submit", "--root", str(tmp_path), "--engine", "shell", "--command", "true", "--target"]
    code, out, err, mods = _console([*args, "greeting.txt"])
    assert code == 0, err
    assert (tmp_path / "fila" / "in" / f"{out.strip()}.json").is_file()
    assert not {"docker", "requests", "urllib3", "fila.worker", "fila.recovery"} & mods
    # Without them the checks all still run: a target outside the project is refused.
    code, _out, err, _mods = _console([*args, "../outside"])
    assert code == 2 and "outside" in err


def test_stored_schemas_are_the_models_and_used_only_while_current(tmp_path: Path, monkeypatch: Any) -> None:
    from fila import models

    stored = json.loads(models._STORED.read_text())
    assert stored["key"] == models._schema_key(), (
        "fila/models.py or states.py changed since fila/_schemas.json was written: regenerate it with "
        "`.venv/bin/python -m fila.entry --write`"
    )
    for kind in ("task", "policy", "record"):
        assert stored["schemas"][kind] == models.schema_for(kind) == models.published_schema(kind)
    # A stored schema from other sources (an edited model) is not used: the models' own is.
    stale = tmp_path / "_schemas.json"
    wrong = {"type": "object", "properties": {"engine": {"const": "nothing-valid"}}}
    stale.write_text(json.dumps({"key": "0" * 64, "schemas": {"task": wrong}}))
    monkeypatch.setattr(models, "_STORED", stale)
    assert models.published_schema("task") == models.schema_for("task")
    stale.write_text(json.dumps({"key": models._schema_key(), "schemas": {"task": wrong}}))
    assert models.published_schema("task") == wrong  # the current key is what selects the file
