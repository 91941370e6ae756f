"""Case 1: per-task overhead. Ten no-op shell tasks on a 100-file project processed by one
`fila run --once`, per task, against the floor for one task (bench/floor.py)."""

from __future__ import annotations

import shutil
import statistics
import time

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio, run, sync
from bench.filaside import Failures, ensure_image, init_root, submit_noops
from bench.floor import FloorSpec, floor_task, new_job
from bench.projects import make_project

TARGET = 1.25


def per_task(ctx: Ctx, *, tasks: int = 10, files: int = 100) -> list[Row]:
    ensure_image()
    reps = ctx.reps_or(7, 2)
    project = make_project(ctx.mkdtemp("project") / "p", files - 1, seed=1).path
    floor_root = init_root(ctx.mkdtemp("floor-root"))
    spec = FloorSpec(floor_root)
    phases: dict[str, list[float]] = {}
    failures = Failures()
    floor_phases: dict[str, list[float]] = {}

    def fila_side() -> float:
        root = init_root(ctx.mkdtemp("root"))
        submit_noops(root, project, tasks)
        sync()
        t = time.perf_counter()
        run([*fila_cmd(), "run", "--once", "--quiet", "--root", str(root)], ok=(0, 1, 6))
        dt = (time.perf_counter() - t) / tasks
        for rec in failures.check(root, tasks):
            for k, v in rec.timings.items():
                phases.setdefault(k, []).append(v)
        phases.setdefault("wall", []).append(dt)
        shutil.rmtree(root, ignore_errors=True)
        return dt

    def floor_side() -> float:
        jobs = ctx.mkdtemp("floor-jobs")
        prepared = []
        for i in range(tasks):
            job = new_job(jobs, i)
            prepared.append((job, spec.docker_args(job, f"fila-bench-{jobs.name}-{i}")))
        sync()
        total = 0.0
        for job, args in prepared:
            steps = floor_task(project, job, args)
            total += steps["total"]
            for k, v in steps.items():
                floor_phases.setdefault(k, []).append(v)
        shutil.rmtree(jobs, ignore_errors=True)
        return total / tasks

    ctx.log(f"per-task: {reps} x ({tasks} fila tasks, {tasks} floor tasks), alternating")
    xs, ys = alternate(fila_side, floor_side, reps)
    f, b = median(xs), median(ys)
    ratio = paired_ratio(xs, ys)
    breakdown = {
        "fila": {k: round(statistics.median(v), 4) for k, v in phases.items()},
        "floor": {k: round(statistics.median(v), 4) for k, v in floor_phases.items()},
    }
    fp, bp = breakdown["fila"], breakdown["floor"]
    note = (
        f"fila: prepare {fp.get('prepare', 0):.3f} run {fp.get('run', 0):.3f} "
        f"diff {fp.get('diff', 0):.3f} total {fp.get('total', 0):.3f}; "
        f"floor: cp {bp['copy']:.3f} run {bp['run']:.3f} diff {bp['diff']:.3f}"
    )
    if failures.count:
        note = f"{failures.note()}; {note}"
    return [
        Row(
            f"per-task overhead ({tasks} no-op tasks, {files} files)",
            f,
            b,
            "s/task",
            target=f"<= {TARGET}",
            ok=ratio <= TARGET and not failures.count,
            ratio=ratio,
            note=note,
            samples={"fila": xs, "floor": ys},
            extra=breakdown,
        )
    ]
