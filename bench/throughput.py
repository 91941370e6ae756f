"""Case 3: throughput. 100 no-op tasks through fila at concurrency 1 and 2, against 100 bare
`docker run --rm` at the same concurrency (the same image, mounts and limits as fila's container;
no copies, no diff: the loop that gives none of fila's guarantees). The target is one small file
by default (`--throughput-files N` for more), so what is measured is the queue, the worker and
the container's life cycle; what copying and diffing many files costs is cases 1 and 4."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio, run, sync
from bench.filaside import Failures, ensure_image, help_text, init_root, submit_noops
from bench.floor import FloorSpec, copy_in, docker_run, new_job
from bench.projects import make_project

TARGET = 0.90


def fila_command(root: Path, n: int) -> tuple[list[str], bool] | None:
    """How fila processes the queue at concurrency `n`: (argv, exits by itself), or None when this
    fila cannot run `n` tasks at once."""
    fila = fila_cmd()
    if "--concurrency" in help_text("run"):
        return [*fila, "run", "--once", "--quiet", "--concurrency", str(n), "--root", str(root)], True
    if "--concurrency" in help_text("worker"):
        return [*fila, "worker", "--concurrency", str(n), "--root", str(root)], False
    if n == 1:
        return [*fila, "run", "--once", "--quiet", "--root", str(root)], True
    return None


def _run_worker(argv: list[str], ids: list[str], timeout: float) -> float:
    """Start a long-running worker, time it until a line naming each id has appeared on its
    stdout, then stop it (SIGINT, as Ctrl-C would)."""
    want = set(ids)
    t = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            for word in line.replace('"', " ").split():
                want.discard(word)
            if not want:
                break
        dt = time.perf_counter() - t
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if want:
        raise RuntimeError(f"bench: the worker stopped before finishing {len(want)} tasks")
    return dt


def throughput(ctx: Ctx) -> list[Row]:
    ensure_image()
    tasks = 10 if ctx.quick else 100
    reps = ctx.reps_or(5, 1)
    files = ctx.throughput_files
    if files <= 1:  # the README's example: one small file, so the machinery is what is measured
        project = ctx.mkdtemp("tp-project") / "p"
        project.mkdir()
        (project / "greeting.txt").write_text("hello\n")
    else:
        project = make_project(ctx.mkdtemp("tp-project") / "p", files - 1, seed=2).path
    spec = FloorSpec(init_root(ctx.mkdtemp("tp-floor-root")))
    rows = []

    def label(n: int) -> str:
        return f"throughput, concurrency {n} ({tasks} no-op tasks, {files} file{'s' * (files > 1)})"

    for n in (1, 2):
        probe = fila_command(ctx.tmp, n)
        if probe is None:
            rows.append(
                Row(
                    label(n),
                    None,
                    None,
                    "tasks/min",
                    target=f">= {TARGET:.2f}",
                    note="not available: this fila has no --concurrency",
                )
            )
            continue
        failures = Failures()
        container: list[float] = []

        def fila_side(n: int = n, failures: Failures = failures, container: list[float] = container) -> float:
            root = init_root(ctx.mkdtemp("tp-root"))
            ids = submit_noops(root, project, tasks)
            cmd = fila_command(root, n)
            assert cmd is not None
            argv, exits = cmd
            sync()
            if exits:
                t = time.perf_counter()
                run(argv, ok=(0, 1, 6))
                dt = time.perf_counter() - t
            else:
                dt = _run_worker(argv, ids, timeout=60 + 30 * tasks)
            container.extend(r.timings.get("run", 0.0) for r in failures.check(root, tasks))
            shutil.rmtree(root, ignore_errors=True)
            return tasks / dt * 60

        def bare_side(n: int = n) -> float:
            jobs = ctx.mkdtemp("tp-bare")
            slots = [new_job(jobs, i) for i in range(n)]
            for job in slots:
                copy_in(project, job)
            argvs = [
                [spec.docker_args(job, f"fila-bench-{jobs.name}-{i}") for i in range(tasks)] for job in slots
            ]
            todo = list(range(tasks))
            lock = threading.Lock()
            errors: list[BaseException] = []

            def loop(slot: int) -> None:
                while True:
                    with lock:
                        if not todo or errors:
                            return
                        i = todo.pop(0)
                    try:
                        docker_run(argvs[slot][i], jobs / f"run{i}.log")
                    except BaseException as e:
                        errors.append(e)

            threads = [threading.Thread(target=loop, args=(k,)) for k in range(n)]
            sync()
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            dt = time.perf_counter() - t
            shutil.rmtree(jobs, ignore_errors=True)
            if errors:
                raise errors[0]
            return tasks / dt * 60

        ctx.log(f"throughput: concurrency {n}, {reps} x ({tasks} fila tasks, {tasks} bare runs)")
        xs, ys = alternate(fila_side, bare_side, reps, warmup=0)
        f, b = median(xs), median(ys)
        ratio = paired_ratio(xs, ys)
        cont = median(container) if container else 0.0
        note = (
            f"wall time per task: fila {60 / f:.3f} s, bare {60 / b:.3f} s; fila's median "
            f"container phase (create to remove) {cont:.3f} s"
        )
        if failures.count:
            note = f"{failures.note()}; {note}"
        rows.append(
            Row(
                label(n),
                f,
                b,
                "tasks/min",
                target=f">= {TARGET:.2f}",
                ok=ratio >= TARGET and not failures.count,
                ratio=ratio,
                note=note,
                samples={"fila": xs, "bare": ys},
            )
        )
    return rows
