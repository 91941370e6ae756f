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
from tests.support.project import make_root

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
        "fila/cli/ changed since fila/_help.py was written: regenerate it with "
        "`.venv/bin/python -m fila.entry --write`"
    )
    assert _help.TEXT == entry.render_help() == _run(_eager(), ["--help"])[1]


def _console(
    args: list[str], env: dict[str, str] | None = None, argv0: str | None = None, prelude: str = ""
) -> Any:
    """The console script in a fresh process, with the modules it imported on stderr's last line
    (an atexit callback prints them: it runs whichever way the process ends). `os._exit` says on
    stderr that it ended the process (`FAST <code>`)."""
    code = (
        "import sys, atexit, json, os\n"
        "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules))))\n"
        "_real_exit = os._exit\n"
        "def _spy(c):\n"
        "    sys.stderr.write('FAST %d\\n' % c)\n"
        "    sys.stderr.flush()\n"
        "    _real_exit(c)\n"
        "os._exit = _spy\n"
        f"{prelude}\n"
        f"sys.argv = [{argv0 or str(FILA)!r}, *{args!r}]\n"
        "from fila.entry import main\n"
        "main()\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **(env or {})}
    )
    mods, _, fast = p.stderr.rpartition("\nMODULES ")[2].partition("FAST")
    err = p.stderr.rpartition("\nMODULES ")[0]
    if fast:  # os._exit ended it, after the atexit callbacks: say so in `err`
        err += "\nFAST" + fast
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
    err = err.partition("\nFAST")[0]
    assert (code, out, err.rstrip("\n")) == (eager[0], eager[1], eager[2].rstrip("\n"))


def test_console_submit_imports_no_container_client(tmp_path: Path) -> None:
    """`fila submit` checks and queues a task: no Docker SDK, HTTP stack or worker is loaded."""
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    args = ["submit", "--root", str(tmp_path), "--engine", "shell", "--command", "true", "--target"]
    code, out, err, mods = _console([*args, "greeting.txt"])
    assert code == 0, err
    assert (tmp_path / "fila" / "in" / f"{out.strip()}.json").is_file()
    assert not {"docker", "requests", "urllib3", "fila.run.worker", "fila.recovery.recover"} & mods
    # Without them the checks all still run: a target outside the project is refused.
    code, _out, err, _mods = _console([*args, "../outside"])
    assert code == 2 and "outside" in err


# What no command below needs on its path: the container client and its HTTP stack (only a
# process that runs a task), the PostgreSQL driver and its pool (only `--queue URL`), the schema
# validator (only for a document the strict model refuses), the worker and recovery.
HEAVY = {
    "docker", "requests", "urllib3", "psycopg", "psycopg_pool", "jsonschema", "fila.run.worker",
    "fila.recovery.recover", "fila.sandbox.docker.backend",
}  # fmt: skip
# Beyond HEAVY, per command: the deny rules (pathspec) only where files are checked.
NOT_NEEDED = {"submit": set(), "ls": {"pathspec"}, "show": {"pathspec"}, "status": {"pathspec"},
              "logs": {"pathspec"}, "schema": {"pathspec"}}  # fmt: skip


def test_each_command_imports_only_what_its_path_needs(tmp_path: Path) -> None:
    """A command that starts importing what its path does not use fails here, by name (every
    such import is start-up paid by each CI job: docs/benchmarks.md, "The one-shot path")."""
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    root = ["--root", str(tmp_path)]
    code, out, err, mods = _console(["submit", *root, "--engine", "shell", "--command", "true", "--target",
                                     "greeting.txt"])  # fmt: skip
    assert code == 0, err
    tid = out.strip()
    got = {"submit": mods}
    for cmd, args in (("ls", root), ("show", [*root, tid]), ("status", root), ("logs", [*root, tid]),
                      ("schema", ["task"])):  # fmt: skip
        code, out, err, got[cmd] = _console([cmd, *args])
        # The allowed counterpart: each command did its work without them.
        assert code == 0, (cmd, err)
        assert out.strip() or cmd == "logs", cmd
    extra = {cmd: sorted((HEAVY | NOT_NEEDED[cmd]) & mods) for cmd, mods in got.items()}
    assert extra == {cmd: [] for cmd in got}, extra


def test_console_submit_to_a_queue_url_opens_one_connection_and_no_pool(tmp_path: Path, pg_url: str) -> None:
    """`fila submit --queue URL` makes one call: one connection (queue/pg/oneconn.py), without
    psycopg_pool (its import, threads and background connection) or the container client."""
    from fila.queue.pg.store import PgQueue

    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    args = ["submit", "--queue", pg_url, "--root", str(tmp_path), "--engine", "shell", "--command", "true"]
    code, out, err, mods = _console([*args, "--target", "greeting.txt"])
    assert code == 0, err
    with PgQueue(pg_url) as q:
        assert q.get(out.strip()).status == "queued"
    assert "psycopg" in mods and not {"psycopg_pool", "docker", "requests"} & mods
    # An unreachable database is still said plainly through the one connection.
    bad = pg_url.replace("host=", "host=/nonexistent")
    code, _out, err, _mods = _console([*args[:2], bad, *args[3:], "--target", "greeting.txt"])
    assert code != 0 and "does not answer" in err, err


def test_stored_schemas_are_the_models_and_used_only_while_current(tmp_path: Path, monkeypatch: Any) -> None:
    from fila.core.models import schema

    stored = json.loads(schema._STORED.read_text())
    assert stored["key"] == schema._schema_key(), (
        "fila/core/models/ or states.py changed since fila/core/models/_schemas.json was written: "
        "regenerate it with `.venv/bin/python -m fila.entry --write`"
    )
    for kind in ("task", "policy", "record"):
        assert stored["schemas"][kind] == schema.schema_for(kind) == schema.published_schema(kind)
    # A stored schema from other sources (an edited model) is not used: the models' own is.
    stale = tmp_path / "_schemas.json"
    wrong = {"type": "object", "properties": {"engine": {"const": "nothing-valid"}}}
    stale.write_text(json.dumps({"key": "0" * 64, "schemas": {"task": wrong}}))
    monkeypatch.setattr(schema, "_STORED", stale)
    assert schema.published_schema("task") == schema.schema_for("task")
    # A copy with the current key is read only when it is owned like the module and writable by no
    # one else: the key is computed from public sources, so it proves nothing about who wrote it.
    stale.write_text(json.dumps({"key": schema._schema_key(), "schemas": {"task": wrong}}))
    _assert_used_only_when_owned_like(stale, Path(schema.__file__),
                                      used=lambda: schema.published_schema("task") == wrong)  # fmt: skip
    assert schema.published_schema("task") == schema.schema_for("task")  # a planted copy: not used


def test_the_stored_schemas_key_covers_every_module_of_the_models_package(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The key hashes each module of core/models/ (and states.py): an edit of any of them, or a
    module added to the package, makes the stored schemas stale."""
    from fila.core.models import schema

    here = Path(schema.__file__).parent
    copy = tmp_path / "core" / "models"
    copy.mkdir(parents=True)
    for source in here.glob("*.py"):
        (copy / source.name).write_bytes(source.read_bytes())
    (tmp_path / "core" / "states.py").write_bytes((here.parent / "states.py").read_bytes())
    current = schema._schema_key()
    monkeypatch.setattr(schema, "__file__", str(copy / "schema.py"))
    assert schema._schema_key() == current  # the same sources: the same key
    assert {"fields.py", "task.py", "policy.py", "record.py"} <= {p.name for p in copy.glob("*.py")}
    for source in [*sorted(copy.glob("*.py")), tmp_path / "core" / "states.py"]:
        before = source.read_bytes()
        source.write_bytes(before + b"\n")
        assert schema._schema_key() != current, source.name
        source.write_bytes(before)
        assert schema._schema_key() == current
    (copy / "extra.py").write_text("X = 1\n")
    assert schema._schema_key() != current


def _assert_used_only_when_owned_like(planted: Path, module: Path, used: Any) -> None:
    """`used()` says whether the file at `planted` was read: it is while the file is owned like
    `module` and not group/other-writable (the counterpart), never otherwise; a symlink to such
    a file is not followed. Leaves the file planted and untrusted (another uid's, or 0666)."""
    os.chmod(planted, 0o644)
    if os.getuid() == 0:
        os.chown(planted, os.stat(module).st_uid, -1)
    assert used()  # the allowed counterpart: a copy owned like the module is what is read
    for mode in (0o664, 0o646, 0o666):
        os.chmod(planted, mode)
        assert not used(), oct(mode)
    os.chmod(planted, 0o644)
    assert used()
    link = planted.with_name("link-" + planted.name)
    real = planted.rename(planted.with_name("real-" + planted.name))
    link.symlink_to(real)
    link.rename(planted)
    assert not used()  # the link is not followed, though what it names would be used
    planted.unlink()
    real.rename(planted)
    assert used()
    if os.getuid() == 0:  # another uid's file needs root to make
        os.chown(planted, 65534, -1)
        assert not used()
    else:
        os.chmod(planted, 0o666)


def test_stored_help_is_used_only_when_owned_like_entry_py(tmp_path: Path, monkeypatch: Any) -> None:
    planted = tmp_path / "_help.py"
    planted.write_text(f'CLI_SHA256 = "{entry.cli_sha256()}"\nTEXT = "PLANTED HELP"\n')
    monkeypatch.setattr(entry, "_HELP", str(planted))
    monkeypatch.setattr(sys, "argv", [str(FILA), "--help"])
    monkeypatch.setenv("COLUMNS", "100")
    _assert_used_only_when_owned_like(planted, Path(entry.__file__),
                                      used=lambda: entry.cached_help() == "PLANTED HELP")  # fmt: skip
    assert entry.cached_help() is None


# -- validation without jsonschema: what the models accept strictly, the schema accepts ---------

_POOL: list[Any] = [
    0, 1, -1, 443, 443.0, 1.5, True, False, None, "", "443", "1g", "1g\n", "0", "a\n", "x\x1cy",
    "https://a\x1cb", "https://a.b/", "/abs\n", "/abs", "rel", "a\u202eb", [], ["a"], [1], [None], {},
    {"a": 1}, "GET /v1/*", "*.example.com", "sha256:" + "a" * 64, 1 << 41, 1e300, "shell", "1000",
]  # fmt: skip


def _base_documents() -> list[tuple[str, dict[str, Any]]]:
    from fila.assets import shipped_dir

    task = {
        "id": "t-1", "prompt": "p", "engine": "shell", "model": "m", "timeout": 5000, "targets": ["a", "b/c"],
        "policy": "default", "command": "true", "options": {"shell": {"command": "true"}},
        "fallback": ["shell"], "project": "/p", "image": "fila/shell:latest", "group": "g",
        "limits": {"memory": "512m", "cpus": 0.5, "pids": 64}, "check": "true",
    }  # fmt: skip
    egress = {
        "allow": [{"host": "*.example.com", "port": 80, "methods": ["GET"]}, {"host": "a.b"}],
        "routes": {"anthropic": {"upstream": "https://api.example.com/", "credential": "KEY",
                                 "header": "x-api-key", "format": "{key}", "paths": ["POST /v1/*"]}},
        "allow_private": ["10.0.0.0/8"], "max_requests": 10, "max_tokens": 1000, "egress_network": "n",
    }  # fmt: skip
    policy = {
        "max_timeout_ms": 9000, "default_timeout_ms": 5000, "network": "allowlist", "egress": egress,
        "projects": ["/p"], "tmpfs": {"tmp": "64m", "home": "64m"}, "waive": ["pids"],
    }  # fmt: skip
    docs = [("task", task), ("policy", policy)]
    docs += [("policy", json.loads(p.read_text())) for p in sorted(shipped_dir("policies").glob("*.json"))]
    return docs


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    import copy

    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def _schema_accepts(kind: str, doc: Any) -> bool:
    from fila.queue.policy import _validator

    return not list(_validator(kind).iter_errors(doc))


def test_strictly_valid_documents_are_schema_valid_on_hostile_variants() -> None:
    """Every field of a full task and of every shipped policy, replaced by hostile values (numbers as
    strings, bools, floats, trailing newlines, control and bidi characters, wrong shapes) or given an
    unknown key: whatever the model accepts strictly (validate_document's shortcut), the schema
    accepts. Both kinds of outcome occur, so the check is not empty."""
    from fila.queue.policy import _strictly_valid

    accepted = refused = 0
    for kind, base in _base_documents():
        assert _strictly_valid(kind, base) and _schema_accepts(kind, base), kind
        variants = [_set(base, path, value) for path in _paths(base) for value in _POOL]
        dicts = [(), *(path for path in _paths(base) if isinstance(_get(base, path), dict))]
        variants += [_set(base, (*path, "unknown"), 1) for path in dicts]
        for doc in variants:
            if _strictly_valid(kind, doc):
                accepted += 1
                assert _schema_accepts(kind, doc), (kind, doc)
            else:
                refused += 1
    assert accepted > 100 and refused > 1000, (accepted, refused)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("policy", ("egress", "allow", 0, "port"), "443"),  # lax pydantic reads it as 443
        ("policy", ("egress", "allow", 0, "port"), True),
        ("policy", ("egress", "routes", "anthropic", "upstream"), "https://a\x1cb/"),  # \s differs
        ("task", ("id",), "t-1\n"),  # Python's $ matches before a final newline
        ("task", ("limits", "memory"), "1g\n"),
        ("task", ("timeout",), "5000"),
    ],
)
def test_documents_only_the_schema_or_lax_models_accept_take_the_full_path(
    kind: str, field: tuple[Any, ...], value: Any
) -> None:
    from fila.core.errors import InvalidInput
    from fila.queue.policy import _strictly_valid, validate_document

    base = next(doc for k, doc in _base_documents() if k == kind)  # the full one of its kind
    validate_document(kind, base)  # the unchanged document passes
    assert _strictly_valid(kind, base)
    doc = _set(base, field, value)
    assert not _strictly_valid(kind, doc)
    with pytest.raises(InvalidInput):
        validate_document(kind, doc)


def test_console_submit_of_a_valid_task_imports_no_jsonschema(tmp_path: Path) -> None:
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    args = ["submit", "--root", str(tmp_path), "--engine", "shell", "--command", "true", "--target"]
    code, _out, err, mods = _console([*args, "greeting.txt"])
    assert code == 0, err
    assert "jsonschema" not in mods
    # A bad value is refused through the schema, naming the field, as before.
    code, _out, err, mods = _console([*args, "greeting.txt", "--timeout", "5"])
    assert code == 2 and "timeout" in err and "jsonschema" in mods


# -- the exit: no interpreter teardown after a command, nothing it would do lost ------------------


def test_commands_end_without_the_teardown_and_keep_exit_codes_and_output(tmp_path: Path) -> None:
    from fila.core.models import schema_for

    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    args = ["submit", "--root", str(tmp_path), "--engine", "shell", "--command", "true", "--id", "t1"]
    code, out, err, _mods = _console([*args, "--target", "greeting.txt"])
    assert (code, out) == (0, "t1\n") and "FAST 0" in err, err
    assert json.loads((tmp_path / "fila" / "out" / "t1.json").read_text())["status"] == "queued"
    code, _out, err, _mods = _console([*args, "--target", "greeting.txt"])  # the same id again
    assert code == 4 and "exists already" in err and "FAST 4" in err, err
    code, _out, err, _mods = _console([*args, "--target", "../outside"])
    assert code == 2 and "outside" in err and "FAST 2" in err, err
    # 29 KB on a pipe: every byte is written before the process ends.
    code, out, err, _mods = _console(["schema", "record"])
    assert code == 0 and json.loads(out) == schema_for("record") and "FAST 0" in err


def test_atexit_callbacks_run_and_a_live_thread_keeps_pythons_exit(tmp_path: Path) -> None:
    done, called = tmp_path / "thread-done", tmp_path / "atexit-called"
    # An atexit callback (weakref finalizers are ones too) runs before the fast exit.
    prelude = f"atexit.register(lambda: open({str(called)!r}, 'w').close())"
    code, _out, err, _mods = _console(["schema", "task"], prelude=prelude)
    assert code == 0 and "FAST 0" in err and called.exists()
    # A non-daemon thread still working: Python's own exit, which waits for it. The thread works
    # until the main thread has ended (no sleep that a loaded machine could outlast before the exit).
    prelude = (
        "import threading\n"
        "threading.Thread(target=lambda: (threading.main_thread().join(), "
        f"open({str(done)!r}, 'w').close())).start()"
    )
    code, _out, err, _mods = _console(["schema", "task"], prelude=prelude)
    assert code == 0 and "FAST" not in err and done.exists()


def test_output_left_in_stdouts_buffer_is_written_before_the_fast_exit(tmp_path: Path) -> None:
    """click flushes after each echo, so its output proves nothing of the exit's own flush: an
    atexit callback (it runs before the exit's flush) writes through sys.stdout without a flush,
    after the command's output, more than stdout's buffer holds."""
    tail = "".join(f"{i:07d}\n" for i in range(2500))  # 20000 bytes, each line numbered
    # Line by line: one write larger than the buffer would go straight to the pipe.
    prelude = f"atexit.register(lambda: [sys.stdout.write(line) for line in {tail!r}.splitlines(True)])"
    buffered = {"PYTHONUNBUFFERED": ""}  # stdout buffered as on any pipe (an empty value is unset)
    # Allowed first: the command's own output arrives, and the fast exit ended the process.
    code, out, err, _mods = _console(["schema", "task"], env=buffered, prelude=prelude)
    assert code == 0 and "FAST 0" in err, err
    head, _, rest = out.partition("0000000\n")
    assert json.loads(head) == json.loads(_console(["schema", "task"])[1])
    assert "0000000\n" + rest == tail, f"{len(rest) + 8} of {len(tail)} bytes arrived"


@pytest.mark.docker
def test_the_ci_path_through_the_console_ends_fast_with_every_record_and_no_container(
    tmp_path: Path, docker_client: Any, shell_image: Any
) -> None:
    """`submit` + `run --once` and `submit --run`, each a console-script process ending by the fast
    exit: the records are durable and complete, the output whole, no container or volume left."""
    from tests.support.containers import containers_left, volumes_left

    root = make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    sub = ["submit", "--root", str(tmp_path), "--engine", "shell", "--target", "greeting.txt"]
    cmd = ["--command", "sed -i s/hello/world/ greeting.txt"]
    code, out, err, _mods = _console([*sub, *cmd, "--id", "two"])
    assert (code, out) == (0, "two\n") and "FAST 0" in err, err
    code, out, err, _mods = _console(["run", "--once", "--json", "--root", str(tmp_path)])
    assert code == 0 and "FAST 0" in err, err
    code, out2, err, _mods = _console([*sub, *cmd, "--id", "one", "--run", "--json"])
    assert code == 0 and "FAST 0" in err, err
    for tid, line in (("two", out), ("one", out2)):
        printed = json.loads(line)
        on_disk = json.loads(root.record_path(tid).read_text())
        assert printed["status"] == on_disk["status"] == "needs_review", (tid, err)
        assert "+world" in (tmp_path / on_disk["patch_path"]).read_text()
    # A task that fails keeps its exit code through the fast exit.
    code, _out, err, _mods = _console([*sub, "--command", "exit 3", "--id", "bad", "--run"])
    assert code == 1 and "FAST 1" in err, err
    assert containers_left(docker_client, root) == [] and volumes_left(docker_client, root) == []
