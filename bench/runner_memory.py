"""Case "runner-memory": one long-running runner's memory over many tasks (docs/scale-out.md).

N shell tasks (`echo` into one file) are queued in a throwaway PostgreSQL cluster (tests/support/pg.py)
and drained by one `fila worker --queue URL --engine shell` on the fake backend (no container: the
runner's own bookkeeping is what is measured). Its resident memory (VmRSS) is read each time a
tenth of the tasks has ended. Rows: RSS at a tenth and at the end, and the growth per task between
the two, whose target is what a runner may keep per task for ever: nothing (under 1 KiB, noise).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import Ctx, Row
from bench.filaside import init_root, pg_runner

GROWTH_TARGET_KB = 1.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"runner-memory: no VmRSS for pid {pid}")


def runner_memory(ctx: Ctx) -> list[Row]:
    from tests.support.pg import cluster

    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.queue.pg import migrate
    from fila.queue.pg.store import PgQueue
    from fila.run.remote_inputs import pack

    n = 500 if ctx.quick else 5000
    ctx.log(f"runner-memory: {n} tasks through one runner on the fake backend and PostgreSQL")
    sub = init_root(ctx.mkdtemp("runmem-sub"))
    (sub / "a.txt").write_text("hello\n")
    runner = init_root(ctx.mkdtemp("runmem-runner"))
    task = Task(engine="shell", command="echo done >> a.txt", targets=["a.txt"])
    packed = pack(Root.at(sub), task.model_copy(update={"id": "m00000"}))
    samples: list[tuple[int, float]] = []
    with cluster() as c:
        url = c.new_database()
        migrate.migrate(url)
        with PgQueue(url) as q:
            for i in range(n):
                tid = f"m{i:05d}"
                q.enqueue_group(
                    [(tid, task.model_copy(update={"id": tid}))], inputs=packed.manifest, files=packed.files
                )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_", "PG"))}
        env.update(FILA_BACKEND="fake", FILA_FAKE_DIR=str(ctx.mkdtemp("runmem-boxes")))
        with pg_runner(ctx, url, runner, "bench-memory", 0.2, env) as worker, PgQueue(url) as q:
            mark = n // 10
            while True:
                time.sleep(0.5)
                if worker.poll() is not None:
                    raise RuntimeError(f"runner-memory: the runner exited {worker.returncode}")
                counts = {s: sum(v.values()) for s, v in q.counts().items()}
                done = n - counts.get("queued", 0) - counts.get("running", 0)
                if done >= mark:
                    samples.append((done, _rss_mb(worker.pid)))
                    ctx.log(f"runner-memory: {done} tasks ended, RSS {samples[-1][1]:.1f} MB")
                    mark += n // 10
                if done >= n:
                    break
    (d0, m0), (d1, m1) = samples[0], samples[-1]
    per_task_kb = (m1 - m0) * 1024 / max(1, d1 - d0)
    note = f"{n} tasks, one runner, fake backend; RSS by tenth: " + ", ".join(f"{m:.0f}" for _, m in samples)
    return [
        Row(f"runner RSS after {d0} tasks", m0, None, "MB", note=note),
        Row(f"runner RSS after {d1} tasks", m1, None, "MB"),
        Row(
            "runner memory kept per task (growth from a tenth to the end)",
            per_task_kb,
            None,
            "KiB",
            target=f"< {GROWTH_TARGET_KB:.0f} KiB",
            ok=per_task_kb < GROWTH_TARGET_KB,
        ),
    ]
