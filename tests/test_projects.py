"""Where a task may point: the directories a task may name as its project are
the queue root and the policy's `projects` (the operator's file), compared as real paths; anything
else is refused at submit and at claim, and show, review and apply name the project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from tests.support.cli import fila
from tests.support.project import make_root, record

CLI = [sys.executable, "-c", "from fila.cli import main; main()"]
SHIPPED = json.loads((Path(__file__).resolve().parents[1] / "policies" / "default.json").read_text())


@pytest.fixture
def proj(tmp_path: Path) -> Root:
    """A queue root, an operator-allowed project beside it (listed in policy `shared`), and a
    forbidden directory holding a 0600 file the fila process can read."""
    root = make_root(tmp_path / "queue")
    (root.path / "greeting.txt").write_text("hello\n")
    for name in ("allowed", "forbidden"):
        d = tmp_path / name
        d.mkdir()
        (d / "greeting.txt").write_text(f"hello from {name}\n")
    (tmp_path / "forbidden" / "greeting.txt").chmod(0o600)
    (root.policies_dir / "shared.json").write_text(
        json.dumps({**SHIPPED, "projects": [str(tmp_path / "allowed")]})
    )
    return root


def submit(root: Root, project: str | None, policy: str = "default", command: str = "true"):
    args = [
        "submit",
        "--engine",
        "shell",
        "--command",
        command,
        "--target",
        "greeting.txt",
        "--policy",
        policy,
    ]
    return fila(root.path, *args, *(["--project", project] if project is not None else []))


def test_submit_refuses_a_project_outside_the_allowed_set_naming_the_setting(proj: Root) -> None:
    other = proj.path.parent
    assert submit(proj, None).exit_code == 0  # the queue root: always allowed
    assert submit(proj, str(proj.path)).exit_code == 0
    res = submit(proj, str(other / "allowed"), policy="shared")
    assert res.exit_code == 0, res.output  # listed by the operator's policy
    res = submit(proj, str(other / "allowed"))  # the same directory, under a policy that does not list it
    assert res.exit_code == 2, res.output
    assert "'projects'" in res.stderr and "default" in res.stderr and str(other / "allowed") in res.stderr
    res = submit(proj, str(other / "forbidden"), policy="shared")
    assert res.exit_code == 2 and "'projects'" in res.stderr, res.output
    assert "hint: an operator adds the directory" in res.stderr


def test_symlinks_and_dot_dot_are_resolved_before_the_comparison(proj: Root) -> None:
    base = proj.path.parent
    (base / "to-allowed").symlink_to(base / "allowed")
    (base / "to-forbidden").symlink_to(base / "forbidden")
    (base / "allowed" / "escape").symlink_to(base / "forbidden")
    assert submit(proj, str(base / "to-allowed"), policy="shared").exit_code == 0  # resolves to a listed dir
    assert submit(proj, "../allowed", policy="shared").exit_code == 0  # relative to the root, resolved
    for tricky in (
        str(base / "to-forbidden"),  # a link into a forbidden place
        str(base / "allowed" / "escape"),  # a link inside an allowed project, pointing out
        str(base / "allowed" / ".." / "forbidden"),
        "../forbidden",
        str(proj.path / "fila"),  # below the root is not the root
        "/",
    ):
        res = submit(proj, tricky, policy="shared")
        assert res.exit_code == 2 and "'projects'" in res.stderr, (tricky, res.output)


def _in_file(root: Root, tid: str, project: str) -> None:
    task = {"engine": "shell", "command": "echo hi > greeting.txt", "targets": ["greeting.txt"],
            "project": project, "policy": "shared"}  # fmt: skip
    (root.in_dir / f"{tid}.json").write_text(json.dumps(task))


@pytest.mark.docker
def test_a_task_dropped_in_fila_in_with_a_forbidden_project_fails_at_claim_without_a_container(
    proj: Root, shell_image: Any, started_containers: Any
) -> None:
    """A task file written straight into fila/in bypasses submit: the claim checks again."""
    base = proj.path.parent
    _in_file(proj, "allowed-one", str(base / "allowed"))
    _in_file(proj, "forbidden-one", str(base / "forbidden"))
    fila(proj.path, "run", "--once")
    assert record(proj.path, "allowed-one")["status"] == "needs_review"
    rec = record(proj.path, "forbidden-one")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec
    assert "'projects'" in rec["error"]["message"]
    assert started_containers.count() == 1, "the forbidden task never started a container"
    assert not proj.job_dir("forbidden-one").exists(), "nothing of the forbidden directory was copied"
    assert (base / "forbidden" / "greeting.txt").read_text() == "hello from forbidden\n"


@pytest.mark.docker
def test_a_listed_project_works_end_to_end_and_every_view_names_it(proj: Root, shell_image: Any) -> None:
    allowed = proj.path.parent / "allowed"
    res = submit(proj, str(allowed), policy="shared", command="echo changed > greeting.txt")
    assert res.exit_code == 0, res.output
    tid = res.stdout.strip()
    res = fila(proj.path, "show", tid)
    assert f"project:   {allowed}" in res.stdout.splitlines()[1], res.stdout  # right under the id
    fila(proj.path, "run", "--once")
    assert record(proj.path, tid)["status"] == "needs_review"

    res = fila(proj.path, "show", tid)
    assert res.stdout.splitlines()[1] == f"project:   {allowed}", res.stdout
    res = fila(proj.path, "review", tid, "--no-pager")
    assert res.stdout.splitlines()[1] == f"project   {allowed}", res.stdout
    assert json.loads(fila(proj.path, "review", tid, "--json").stdout)["project"] == str(allowed)
    html = Path(json.loads(fila(proj.path, "review", tid, "--html", "--json").stdout)["html"]).read_text()
    assert f"<tr><td>project</td><td>{allowed}</td></tr>" in html

    # apply's confirmation names the project before anything is written; "n" writes nothing.
    env = {**os.environ, "FILA_ROOT": str(proj.path)}
    prompt = _apply_on_a_terminal(tid, env, answer=b"n\n")
    assert f"project: {allowed}" in prompt and f"apply task {tid} to {allowed}?" in prompt, prompt
    assert (allowed / "greeting.txt").read_text() == "hello from allowed\n"
    res = fila(proj.path, "apply", tid, "--yes")
    assert res.exit_code == 0 and f"applied {tid} to {allowed}" in res.stdout, res.output
    assert (allowed / "greeting.txt").read_text() == "changed\n"
    assert (proj.path / "greeting.txt").read_text() == "hello\n", "the queue root was not the project"


def _apply_on_a_terminal(tid: str, env: dict[str, str], *, answer: bytes) -> str:
    """`fila apply` with its stdin on a pseudo-terminal (it only asks there); returns stderr."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen([*CLI, "apply", tid], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)  # fmt: skip
        os.write(master, answer)
        _out, err = proc.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 1, err
    return err.decode()
