"""Case: the whole cycle without containers, through the fake backend (sandbox/fake.py).

Each task is submitted, claimed and run to its review record by `cycle.run_one` (job directory,
copy, the backend's run, diff, record), with the container replaced by a FakeBackend script
that writes one file: what is measured is fila's own work per task, with no engine to wait for.
A second row runs each task's command on the host (`sh -c` in work/, the fake's command mode);
a third signs each task's run statement (a root with a key: docs/provenance.md), and a fourth
times `fila verify`'s check of one task. There is no floor: the number is the ceiling a container
engine's cost is added to.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.common import Ctx, Row, median


def fake_cycle(base: Path, n: int, *, scripted: bool, signed: bool = False) -> float:
    """Seconds to take `n` shell tasks from submitted to needs_review on a fresh root (`signed`:
    one with a signing key, so each task's run statement is signed too)."""
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.queue import store as queue
    from fila.run import job as cycle
    from fila.sandbox.fake import Act, FakeBackend

    root = Root.at(base / "root")
    for d in root.all_dirs():
        d.mkdir(parents=True, exist_ok=True)
    (root.path / "greeting.txt").write_text("hello\n")
    if signed:
        from fila.provenance import keys

        keys.init(root)
    act = Act(files={"greeting.txt": "changed\n"})
    backend = FakeBackend(base / "boxes", script=(lambda _s: act) if scripted else None)
    task = Task(engine="shell", command="echo changed > greeting.txt", targets=["greeting.txt"])
    for i in range(n):
        queue.enqueue(root, f"c{i:06d}", task)
    worker = queue.new_worker_id()
    t = time.perf_counter()
    done = 0
    while (claim := cycle.next_claim(root, worker)) is not None:
        rec = cycle.run_one(root, claim, backend=backend)
        if rec is None or rec.status.value != "needs_review":
            raise RuntimeError(f"bench: task {claim.task_id} ended {rec and rec.status}")
        done += 1
    if done != n:
        raise RuntimeError(f"bench: ran {done} of {n} tasks")
    return time.perf_counter() - t


def verify_ms(base: Path, n: int) -> float:
    """Milliseconds per `fila verify` check (record, patch, statement, trusted keys) of the
    tasks a signed cycle left in `base`'s root."""
    from fila.core.layout import Root
    from fila.provenance.sources import FileSource
    from fila.queue import store as queue
    from fila.review import attested

    root = Root.at(base / "root")
    recs = [r for r in queue.all_records(root) if r.patch_path][:n]
    t = time.perf_counter()
    for rec in recs:
        data = (root.path / str(rec.patch_path)).read_bytes()
        if attested.verdict(FileSource(root), rec, data).state != "verified":
            raise RuntimeError(f"bench: task {rec.id} does not verify")
    return (time.perf_counter() - t) * 1000 / max(1, len(recs))


def measure(tmp: Path, n: int, reps: int) -> list[Row]:
    rows = []
    checks = []
    for scripted, signed, what in ((True, False, "scripted run"), (False, False, "host command"),
                                   (True, True, "scripted run, signed")):  # fmt: skip
        rates = []
        for _ in range(reps):
            base = Path(tempfile.mkdtemp(prefix="cycle-fake-", dir=tmp))
            try:
                rates.append(n / fake_cycle(base, n, scripted=scripted, signed=signed))
                if signed:
                    checks.append(verify_ms(base, n))
            finally:
                shutil.rmtree(base, ignore_errors=True)
        rows.append(
            Row(
                f"cycle via FakeBackend, {what} ({n} tasks, no Docker)",
                median(rates),
                None,
                "tasks/s",
                note="no floor: fila's own work per task",
                samples={"fila": rates},
            )
        )
    rows.append(Row("verify one task's provenance (record, patch, statement)", median(checks), None, "ms",
                    note="docs/provenance.md", samples={"fila": checks}))  # fmt: skip
    return rows


def cycle_fake(ctx: Ctx) -> list[Row]:
    n = 20 if ctx.quick else 200
    reps = ctx.reps_or(3, 1)
    ctx.log(f"cycle-fake: {reps} x {n} tasks through the fake backend, scripted then host command")
    return measure(ctx.tmp, n, reps)
