"""The CLI: in-process (typer's CliRunner) for what it prints, as a process for what it does to the
machine (a crash point, a killed worker, the exit code a script sees)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fila.core.layout import Root

# The CLI as a process, and the console script's own path (what CI runs): the fast exit
# (os._exit after the command) included.
CLI = [sys.executable, "-c", "from fila.cli import main; main()"]
ENTRY = [sys.executable, "-c", "from fila.entry import main; main()"]
# The installed console script itself.
FILA_SCRIPT = str(Path(sys.executable).with_name("fila"))


def fila(root: Path | Root, *args: str, env: dict[str, str] | None = None, input: str | None = None):
    """The CLI in-process (typer's CliRunner), on the queue root `root`."""
    from typer.testing import CliRunner

    from fila.cli import app

    path = root.path if isinstance(root, Root) else root
    return CliRunner().invoke(app, [*args, "--root", str(path)], env=env, input=input)


def fila_process(
    root: Root,
    *args: str,
    crash: str | None = None,
    check: bool = False,
    timeout: float = 120,
    env_extra: dict[str, str] | None = None,
    entry: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The CLI as a process on `root` (FILA_ROOT), SIGKILLing itself at the fault point `crash`."""
    env = {**os.environ, "FILA_ROOT": str(root.path), **(env_extra or {})}
    env.pop("FILA_CRASH_AT", None)
    if crash:
        env["FILA_CRASH_AT"] = crash
    cli = ENTRY if entry else CLI
    res = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def submit_shell(root: Path | Root, command: str, *targets: str, extra: tuple[str, ...] = ()) -> str:
    """Submit a shell task through the CLI (in-process) and return its id."""
    args = ["submit", "--engine", "shell", "--command", command, *extra]
    for t in targets or ("greeting.txt",):
        args += ["--target", t]
    res = fila(root, *args)
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def submit_process(
    root: Root, tid: str, command: str, *extra: str, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Submit the shell task `tid` on greeting.txt through the CLI as a process (`kw` as for
    fila_process: check, crash, env_extra...)."""
    args = ("submit", "--id", tid, "--engine", "shell", "--command", command, "--target", "greeting.txt")
    return fila_process(root, *args, *extra, **kw)


def run_shell(
    root: Path | Root,
    command: str,
    *targets: str,
    status: str = "needs_review",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> str:
    """Submit a shell task (submit_shell), run the queue once (in-process), and return the task's
    id once its record says `status` (and, for a task that reached review, the run said 0)."""
    from tests.support.project import record

    tid = submit_shell(root, command, *targets, extra=extra)
    res = fila(root, "run", "--once", env=env)
    assert record(root, tid)["status"] == status, (res.output, record(root, tid))
    assert status != "needs_review" or res.exit_code == 0, res.output
    return tid


def run_once_console(
    root: Path | Root, env: dict[str, str] | None = None, *, timeout: float = 600, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """`fila run --once` through the console script, in a child process as a person runs it, with
    `env` over this process's environment."""
    path = root.path if isinstance(root, Root) else root
    return subprocess.run(
        [FILA_SCRIPT, "run", "--once", "--root", str(path)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
