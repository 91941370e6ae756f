"""Runners of the PostgreSQL queue in the tests: `fila` commands against a queue URL, in this
process (CliRunner) or as separate processes ("hosts": each its own local root, host id and fake
container engine state), and what the database says about a task."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

CLI = [sys.executable, "-m", "fila"]


def fila(*args: str, env: dict[str, str] | None = None) -> Result:
    """`fila ARGS` in this process; `env` is added to the environment for the call."""
    from fila.cli import app

    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


def host_env(base: Path, name: str) -> dict[str, str]:
    """The environment of one runner "host": the fake backend with its own box directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_CRASH", "PG"))}
    env.update({"FILA_BACKEND": "fake", "FILA_FAKE_DIR": str(base / f"{name}.boxes")})
    return env


def start_worker(
    url: str, root: Path, host: str, *extra: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """`fila worker --queue URL --root ROOT --host-id HOST EXTRA...` as its own process; its stderr
    goes to ROOT/../HOST.err."""
    err = open(root.parent / f"{host}.err", "wb")  # noqa: SIM115 (the process holds it)
    try:
        return subprocess.Popen(
            [*CLI, "worker", "--queue", url, "--root", str(root), "--host-id", host, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    finally:
        err.close()


def events(q: Any, tid: str, name: str) -> list[dict[str, Any]]:
    return [e for e in q.events(tid) if e["event"] == name]
