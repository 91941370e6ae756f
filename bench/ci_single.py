"""Case ci-single: the CI path, one task from nothing to a reviewed diff, process start-up included.

A pipeline runs one task per job, each command a fresh process. Three sides, alternating in one run
(floor, two commands, one process, floor, ...), each on a fresh queue root and the same 100-file
project, the task a `sed` on one file:

- floor: `cp -a` twice, a `docker run --rm` derived from fila's create_kwargs key by key (never
  weaker, bench/floor.py), `git diff --no-index`;
- two commands: `fila submit ...` then `fila run --once --json`, two processes;
- one process: `fila submit ... --run --json` (skipped when this fila has no `--run`).

Also `fila submit` alone and `fila --help` next to `python -c pass`, and the least any code built on
the chosen libraries can take: importing them and nothing else (LIBRARIES), typer with the pydantic
it coerces every option through for `submit`, and the Docker SDK as well for a process that runs a
task. Those rows say how far the targets are reachable at all: the one-process form cannot be
faster than the floor plus the run's imports, the two-command form than the floor plus both.

The breakdown is the median of each phase of the records' `timings` (start-up, claim, begin,
validate, prepare, create, start_wait, remove, diff, record); the two-command form's start-up is
its second process's, the submit being timed apart (`submit` in the breakdown).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from itertools import count
from pathlib import Path

from bench.common import Ctx, Row, fila_cmd, median, paired_ratio, run, sync
from bench.filaside import allow_project, ensure_image, help_text, init_root
from bench.floor import FloorSpec, copy_in, docker_run, git_diff, new_job
from bench.projects import make_project

TWO_TARGET = 2.0  # x the floor: `submit` + `run --once`, two processes
ONE_TARGET = 1.3  # x the floor: `submit --run`, one process
SUBMIT_TARGET_S = 0.15
HELP_TARGET_S = 0.1
SED = "sed -i 's/a/b/' f0000.txt"
# What a process must import before it can do anything with the chosen dependencies: typer (0.29
# builds a pydantic TypeAdapter per option, typer._adapters), and for running a task the Docker
# SDK (requests, urllib3). No fila module: these are the floor under fila's own start-up.
LIBRARIES = {
    "submit": "import typer, typer._adapters",
    "run": "import typer, typer._adapters, docker",
}


def _first_file(project: Path) -> str:
    return sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())[0]


def floor_task_chowned(project: Path, job: Path, args: list[str]) -> dict[str, float]:
    """floor.floor_task, plus what fila does when it runs as root (the engine never does): work/
    handed to the container's uid (`chown -R`), so the engine can write it."""
    t0 = time.perf_counter()
    copy_in(project, job)
    if os.getuid() == 0:
        uid, gid = args[args.index("-u") + 1].split(":")
        run(["chown", "-R", f"{uid}:{gid}", str(job / "work")])
    t1 = time.perf_counter()
    docker_run(args, job.parent / f"{job.name}.log")
    t2 = time.perf_counter()
    git_diff(job)
    t3 = time.perf_counter()
    return {"copy": t1 - t0, "run": t2 - t1, "diff": t3 - t2, "total": t3 - t0}


def floor_round(ctx: Ctx, spec: FloorSpec, project: Path, phases: dict[str, list[float]]) -> float:
    """One task the floor's way (floor_task_chowned) in a fresh job directory: its total; each
    step's seconds appended to `phases`."""
    jobs = ctx.mkdtemp("floor-jobs")
    job = new_job(jobs, 0)
    args = spec.docker_args(job, f"fila-bench-{jobs.name}")
    sync()
    steps = floor_task_chowned(project, job, args)
    for k, v in steps.items():
        phases.setdefault(k, []).append(v)
    shutil.rmtree(jobs, ignore_errors=True)
    return steps["total"]


def ci_single(ctx: Ctx, *, files: int = 100) -> list[Row]:
    ensure_image()
    reps = ctx.reps_or(9, 2)
    project = make_project(ctx.mkdtemp("ci-project") / "p", files, seed=3).path
    sed = SED.replace("f0000.txt", _first_file(project))
    floor_root = init_root(ctx.mkdtemp("ci-floor-root"))
    spec = FloorSpec(floor_root, command=sed)
    fila = fila_cmd()
    one_process = "--run" in help_text("submit")
    ids = count()
    # FILA_BENCH_BEFORE=DIR (a checkout's src/ of an earlier commit): its two-command form and
    # start-up run as one more side of the same alternation, for a before/after under one load.
    before = os.environ.get("FILA_BENCH_BEFORE")
    # Bytecode as an installed fila has it: compiled once (the warm-up round), never recompiled
    # on every start because the environment forbids writing it (PYTHONDONTWRITEBYTECODE) while
    # the sources keep changing. Both sides get the same environment.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    before_env = {**env, "PYTHONPATH": before} if before else None
    # The earlier tree's own console entry: this venv's `fila` script names today's (fila.entry),
    # which an older src/ may not have.
    entry = "fila.entry" if before and (Path(before) / "fila" / "entry.py").exists() else "fila.cli"
    fila_before = [
        sys.executable,
        "-c",
        f"import sys; sys.argv[0] = 'fila'; from {entry} import main; sys.exit(main())",
    ]
    phases: dict[str, dict[str, list[float]]] = {"two": {}, "one": {}, "before": {}, "floor": {}}
    failed: list[str] = []

    def fresh_root() -> Path:
        root = init_root(ctx.mkdtemp("ci-root"))
        from fila.core.layout import Root

        allow_project(Root.at(root), project)
        return root

    def submit_argv(root: Path, cmd: list[str] = fila) -> list[str]:
        return [
            *cmd,
            "submit",
            "--root",
            str(root),
            "--engine",
            "shell",
            "--command",
            sed,
            "--target",
            ".",
            "--project",
            str(project),
            "--id",
            f"ci{next(ids)}",
        ]

    def keep(side: str, out: bytes, extra: dict[str, float]) -> None:
        lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        if len(lines) != 1 or lines[0].get("status") != "needs_review":
            failed.append(f"{side}: {out.decode(errors='replace')[:300]}")
            return
        for k, v in {**lines[0].get("timings", {}), **extra}.items():
            phases[side].setdefault(k, []).append(v)

    def two_commands(side: str = "two", env: dict[str, str] = env) -> float:
        root = fresh_root()
        sync()
        t = time.perf_counter()
        cmd = fila_before if side == "before" else fila
        run(submit_argv(root, cmd), env=env)
        t1 = time.perf_counter()
        p = run(
            [*cmd, "run", "--once", "--json", "--quiet", "--root", str(root)],
            stdout=subprocess.PIPE,
            ok=(0, 1),
            env=env,
        )
        dt = time.perf_counter() - t
        keep(side, p.stdout, {"submit": t1 - t, "run_once": dt - (t1 - t), "wall": dt})
        shutil.rmtree(root, ignore_errors=True)
        return dt

    def one_command() -> float:
        root = fresh_root()
        sync()
        t = time.perf_counter()
        p = run(
            [*submit_argv(root), "--run", "--json", "--quiet"], stdout=subprocess.PIPE, ok=(0, 1), env=env
        )
        dt = time.perf_counter() - t
        keep("one", p.stdout, {"wall": dt})
        shutil.rmtree(root, ignore_errors=True)
        return dt

    def floor_side() -> float:
        return floor_round(ctx, spec, project, phases["floor"])

    ctx.log(f"ci-single: {reps} x (floor, submit + run --once, submit --run), alternating")
    fl: list[float] = []
    two: list[float] = []
    one: list[float] = []
    bef: list[float] = []
    for i in range(reps + 1):  # the first round warms the page cache and the daemon: discarded
        f, t2 = floor_side(), two_commands()
        t1 = one_command() if one_process else None
        tb = two_commands("before", before_env) if before_env else None
        if i:
            fl.append(f)
            two.append(t2)
            if t1 is not None:
                one.append(t1)
            if tb is not None:
                bef.append(tb)

    # Start-up: `fila --help` and `fila submit` against the interpreter doing nothing.
    def wall(argv: list[str], env: dict[str, str] = env) -> float:
        t = time.perf_counter()
        run(argv, env=env)
        return time.perf_counter() - t

    root = fresh_root()
    hx, sx, px, hb, sb = [], [], [], [], []
    libs: dict[str, list[float]] = {k: [] for k in LIBRARIES}
    for _ in range(max(5, reps)):
        px.append(wall([sys.executable, "-c", "pass"]))
        for k, code in LIBRARIES.items():
            libs[k].append(wall([sys.executable, "-c", code]))
        hx.append(wall([*fila, "--help"]))
        sx.append(wall(submit_argv(root)))
        if before_env:
            hb.append(wall([*fila_before, "--help"], before_env))
            sb.append(wall(submit_argv(root, fila_before), before_env))
    shutil.rmtree(root, ignore_errors=True)

    breakdown = {
        side: {k: round(statistics.median(v), 4) for k, v in got.items()} for side, got in phases.items()
    }
    note_fail = f"FAILED {len(failed)}: {failed[0]}" if failed else ""

    # The least ratio these libraries allow each form: the floor plus the imports the form's
    # processes cannot skip, against the floor (medians: the imports are not paired with a floor).
    least = {
        "two": (median(fl) + median(libs["submit"]) + median(libs["run"])) / median(fl),
        "one": (median(fl) + median(libs["run"])) / median(fl),
    }

    def row(name: str, xs: list[float], target: float, form: str = "") -> Row:
        r = paired_ratio(xs, fl[: len(xs)])
        bound = f"least with these libraries x{least[form]:.2f}" if form else ""
        return Row(
            name,
            median(xs),
            median(fl[: len(xs)]),
            "s",
            target=f"<= {target}",
            ok=r <= target and not failed,
            ratio=r,
            note="; ".join(n for n in (note_fail, bound) if n),
            samples={"fila": xs, "floor": fl},
            extra={**breakdown, "least": {k: round(v, 3) for k, v in least.items()}},
        )

    rows = [row("ci-single: submit + run --once (2 processes)", two, TWO_TARGET, "two")]
    if bef:
        rows.insert(0, row("ci-single: BEFORE submit + run --once", bef, TWO_TARGET))
    if one_process:
        rows.append(row("ci-single: submit --run (1 process)", one, ONE_TARGET, "one"))
    else:
        rows.append(Row("ci-single: submit --run (1 process)", None, median(fl), "s", note="no --run here"))
    startup_rows = [
        ("ci-single: fila submit", sx, SUBMIT_TARGET_S),
        ("ci-single: fila --help", hx, HELP_TARGET_S),
    ]
    if before_env:
        startup_rows += [
            ("ci-single: BEFORE fila submit", sb, SUBMIT_TARGET_S),
            ("ci-single: BEFORE fila --help", hb, HELP_TARGET_S),
        ]
    for name, xs, target in startup_rows:
        rows.append(
            Row(
                name,
                median(xs),
                median(px),
                "s",
                target=f"< {target} s",
                ok=median(xs) < target,
                ratio=paired_ratio(xs, px),
                samples={"fila": xs, "python -c pass": px},
                note="baseline: python -c pass",
            )
        )
    for k, code in LIBRARIES.items():
        rows.append(
            Row(
                f"ci-single: LIBRARIES alone, {k} ({code.removeprefix('import ')})",
                median(libs[k]),
                median(px),
                "s",
                ratio=paired_ratio(libs[k], px),
                samples={"libraries": libs[k], "python -c pass": px},
                note="baseline: python -c pass; no fila code",
            )
        )
    return rows
