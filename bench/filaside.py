"""The fila side: queue roots, no-op tasks, the image, the records a run left."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import Ctx, fila_cmd, run
from bench.floor import IMAGE


def init_root(path: Path) -> Path:
    run([*fila_cmd(), "init", "--root", str(path)])
    return path


def submit_noops(root: Path, project: Path, n: int, *, command: str = "true") -> list[str]:
    """Queue `n` shell tasks running `command` on the whole project (in-process: not timed)."""
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.run.intake import submit

    r = Root.at(root)
    allow_project(r, project)
    ids = []
    for i in range(n):
        task = Task(id=f"t{i:04d}", engine="shell", command=command, targets=["."], project=str(project))
        ids.append(submit(r, task).id)
    return ids


def allow_project(r: Any, project: Path) -> None:
    """The root's `default` policy names the bench project in `projects` (a task may
    point only at the queue root or an operator-listed directory)."""
    import json

    from fila.assets import shipped_dir

    path = r.policies_dir / "default.json"
    data = json.loads((path if path.exists() else shipped_dir("policies") / "default.json").read_text())
    if str(project) not in data.get("projects", []):
        data["projects"] = [*data.get("projects", []), str(project)]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


def records(root: Path) -> list[Any]:
    from fila.core.layout import Root
    from fila.queue.store import all_records

    return all_records(Root.at(root))


class Failures:
    """Tasks fila did not take to needs_review: a no-op task must never fail, so each one is
    reported with the table (the run goes on, so the rest is still measured)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.first: str = ""

    def check(self, root: Path, n: int) -> list[Any]:
        """The records under `root`; counts those that are not needs_review (or missing)."""
        recs = records(root)
        self.total += n
        bad = [r for r in recs if r.status != "needs_review"]
        self.count += len(bad) + max(0, n - len(recs))
        if bad and not self.first:
            r = bad[0]
            msg = r.error.message if r.error else ""
            self.first = f"{r.id} {r.status}: {msg.splitlines()[0] if msg else ''}"[:300]
        return [r for r in recs if r.status == "needs_review"]

    def note(self) -> str:
        return f"fila FAILED {self.count}/{self.total} no-op tasks ({self.first})" if self.count else ""


def ensure_image() -> None:
    """The shell engine's image, built once when missing (`fila images build shell`)."""
    p = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, check=False)
    if p.returncode != 0:
        run([*fila_cmd(), "images", "build", "shell"], stderr=None)


def help_text(*args: str) -> str:
    p = subprocess.run([*fila_cmd(), *args, "--help"], capture_output=True, text=True, check=False)
    return p.stdout


@contextmanager
def pg_runner(
    ctx: Ctx, url: str, root: Path, host_id: str, poll: float, env: dict[str, str]
) -> Iterator[Any]:
    """`fila worker --queue URL --engine shell` on `root` as its own process while the block runs
    (its stderr in ctx.tmp/HOST_ID.err), then stopped as a runner host stops it (SIGTERM)."""
    err = open(ctx.tmp / f"{host_id}.err", "wb")  # noqa: SIM115 (the runner holds it)
    worker = subprocess.Popen(
        [*fila_cmd(), "worker", "--queue", url, "--root", str(root), "--engine", "shell",
         "--host-id", host_id, "--poll", str(poll)],
        stdout=subprocess.DEVNULL, stderr=err, env=env,
    )  # fmt: skip
    try:
        yield worker
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        err.close()
