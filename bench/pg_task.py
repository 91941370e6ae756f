"""Case "pg-task": a real task's overhead on the PostgreSQL queue beside the file queue (issue 23's
target: within 10%).

The same shell-engine task (`echo` into one file of a 20-file project), in a real Docker container
(`fila/shell:latest`), from the submit to its record, timed as the user waits for it:

- file queue: `fila submit --root ROOT ... --run` (the submitting process runs the task);
- PostgreSQL queue: `fila submit --queue URL --root ROOT ... --run`, with one runner,
  `fila worker --queue URL --engine shell` (its own root), started once before the rounds and
  polling the whole time, as a runner host does: the task and its targets go into the database,
  the runner claims, lays them out, runs the container, publishes the record and blobs, and the
  submitter sees the record.

Rounds alternate the two sides after one discarded pair; rows: the medians of each side and the
paired ratio. The database is a throwaway cluster on a unix socket (tests/support/pg.py:
Debian's server binaries)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio, run
from bench.filaside import ensure_image, init_root, pg_runner

TARGET = 1.10
COMMAND = "echo done >> a.txt"


def _project(root: Path, files: int = 20) -> None:
    for i in range(files - 1):
        (root / "src" / f"m{i:02d}.py").parent.mkdir(exist_ok=True)
        (root / "src" / f"m{i:02d}.py").write_text(f"x = {i}\n" * 20)
    (root / "a.txt").write_text("hello\n")


def _submit(root: Path, *queue: str) -> float:
    argv = [*fila_cmd(), "submit", "--root", str(root), *queue, "--engine", "shell", "--command", COMMAND,
            "-t", "a.txt", "--run"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("FILA_QUEUE", "FILA_BACKEND")}
    t = time.perf_counter()
    p = run(argv, cwd=root, env=env, stdout=subprocess.PIPE)
    dt = time.perf_counter() - t
    if b"needs_review" not in p.stdout:
        raise RuntimeError(f"pg-task: {' '.join(argv[-8:])} ended {p.stdout.decode(errors='replace')[:300]}")
    return dt


def pg_task(ctx: Ctx) -> list[Row]:
    from tests.support.pg import cluster

    from fila.queue.pg import migrate

    ensure_image()
    reps = ctx.reps_or(7, 2)
    ctx.log(f"pg-task: one shell task in Docker, submit to record, file queue vs PostgreSQL, {reps} rounds")
    file_root = init_root(ctx.mkdtemp("pgtask-file"))
    pg_root = init_root(ctx.mkdtemp("pgtask-sub"))
    runner_root = init_root(ctx.mkdtemp("pgtask-runner"))
    for r in (file_root, pg_root):
        _project(r)
    with cluster() as c:
        url = c.new_database()
        migrate.migrate(url)
        env = {k: v for k, v in os.environ.items() if k not in ("FILA_QUEUE", "FILA_BACKEND")}
        with pg_runner(ctx, url, runner_root, "bench-runner", 1, env):
            fq, pq = alternate(lambda: _submit(file_root), lambda: _submit(pg_root, "--queue", url), reps)
    ratio = paired_ratio(pq, fq)
    return [
        Row(
            "a real task on the pg queue, submit --run to its record (baseline: file queue)",
            median(pq),
            median(fq),
            "s",
            target=f"<= {TARGET:.2f}",
            ok=ratio <= TARGET,
            ratio=ratio,
            note=f"shell engine in Docker, one polling runner, {reps} rounds",
            samples={"fila": pq, "floor": fq},
        )
    ]
