"""Case 1: per-task overhead. Ten no-op shell tasks on a 100-file project processed by one
`fila run --once`, per task, against the floor for one task (bench/floor.py).

`--backend podman` measures the same through rootless Podman: as root, the bench makes a
throwaway ordinary user (subordinate ids from useradd, no docker group), and as that user runs
both sides: `FILA_BACKEND=podman fila run --once` (the policy waives memory, pids and cpus, which
rootless Podman cannot enforce on cgroup v1) against a floor of `cp -a` twice, `podman run --rm`
with the hardening of Docker's floor translated flag for flag (less the waived limits, plus
`--userns keep-id`, as fila's request has) and `git diff`. Each side is timed by the user's own
process, so `runuser` costs neither. The user, its processes and its files are removed after."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio, run, sync
from bench.filaside import Failures, ensure_image, init_root, submit_noops
from bench.floor import FloorSpec, floor_task, new_job
from bench.projects import make_project
from bench.rootless import WAIVED, podman_user

TARGET = 1.0  # not copying twice should beat a loop that does


def per_task(ctx: Ctx, *, tasks: int = 10, files: int = 100, backend: str = "docker") -> list[Row]:
    if backend == "podman":
        return per_task_podman(ctx, tasks=tasks, files=files)
    if backend != "docker":
        raise ValueError(f"per-task: unknown backend {backend!r} (docker or podman)")
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
    return [
        _row(
            f"per-task overhead ({tasks} no-op tasks, {files} files)", xs, ys, phases, floor_phases, failures
        )
    ]


def _row(
    case: str,
    xs: list[float],
    ys: list[float],
    phases: dict[str, list[float]],
    floor_phases: dict[str, list[float]],
    failures: Failures,
) -> Row:
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
    return Row(
        case,
        median(xs),
        median(ys),
        "s/task",
        target=f"<= {TARGET}",
        ok=ratio <= TARGET and not failures.count,
        ratio=ratio,
        note=note,
        samples={"fila": xs, "floor": ys},
        extra=breakdown,
    )


# --- rootless Podman, as an ordinary user ---------------------------------------------------------

# The limits rootless Podman on cgroup v1 cannot enforce (rootless.WAIVED): the floor leaves them out too.
_WAIVED_FLAGS = ("--memory", "--memory-swap", "--cpus", "--pids-limit")


def podman_run_args(docker_argv: list[str]) -> list[str]:
    """Docker's floor command (bench/floor.py, translated from fila's create_kwargs) as the same
    `podman run`: the waived limits out, `--userns keep-id` in (the engine runs as the user's own
    uid, as fila asks Podman for), a tmpfs owned by the container's user (`U`: Podman has no
    uid=/gid= there, and fila maps them the same way), and Podman's k8s-file log with the size
    cap (no rotation count, as fila's request)."""
    if docker_argv[:3] != ["docker", "run", "--rm"]:
        raise ValueError(f"bench: not a floor command: {docker_argv[:3]}")
    out = ["podman", "run", "--rm", "--userns", "keep-id"]
    it = iter(docker_argv[3:])
    for arg in it:
        if arg in _WAIVED_FLAGS:
            next(it)
        elif arg == "--tmpfs":
            target, _, opts = next(it).partition(":")
            kept = [o for o in opts.split(",") if not o.startswith(("uid=", "gid="))]
            out += [
                "--tmpfs",
                f"{target}:{','.join([*kept, 'U'] if len(kept) < len(opts.split(',')) else kept)}",
            ]
        elif arg == "--log-driver":
            if next(it) != "json-file":
                raise ValueError("bench: the floor's log driver changed; update podman_run_args")
            out += ["--log-driver", "k8s-file"]
        elif arg == "--log-opt":
            opt = next(it)
            if not opt.startswith("max-file="):
                out += ["--log-opt", opt]
        else:
            out.append(arg)
    return out


def per_task_podman(ctx: Ctx, *, tasks: int = 10, files: int = 100) -> list[Row]:
    reps = ctx.reps_or(7, 2)
    with podman_user(ctx, "bench.per_task") as user:
        mine = ctx.mkdtemp("podman")
        os.chown(mine, user.uid, user.uid)
        project = make_project(mine / "project", files - 1, seed=1).path
        subprocess.run(["chown", "-R", f"{user.uid}:{user.uid}", str(project)], check=True)
        ctx.log(f"per-task (podman): building fila/shell as {user.name} (rootless Podman)")
        user.py("image", str(mine / "image-root"), timeout=1800)
        phases: dict[str, list[float]] = {}
        floor_phases: dict[str, list[float]] = {}
        failures = Failures()
        n = 0

        def fila_side() -> float:
            nonlocal n
            n += 1
            root = mine / f"root{n}"
            user.py("prepare", str(root), str(project), str(tasks))
            sync()
            dt = float(user.py("fila", str(root)).stdout.split()[-1]) / tasks
            for rec in failures.check(root, tasks):
                for k, v in rec.timings.items():
                    phases.setdefault(k, []).append(v)
            phases.setdefault("wall", []).append(dt)
            shutil.rmtree(root, ignore_errors=True)
            return dt

        def floor_side() -> float:
            nonlocal n
            n += 1
            jobs = mine / f"floor{n}"
            out = json.loads(user.py("floor", str(jobs), str(project), str(mine / "image-root"),
                                     str(tasks)).stdout.splitlines()[-1])  # fmt: skip
            for steps in out:
                for k, v in steps.items():
                    floor_phases.setdefault(k, []).append(v)
            shutil.rmtree(jobs, ignore_errors=True)
            return sum(s["total"] for s in out) / tasks

        ctx.log(
            f"per-task (podman): {reps} x ({tasks} fila and {tasks} floor tasks) as {user.name}, alternating"
        )
        xs, ys = alternate(fila_side, floor_side, reps)
    case = f"per-task overhead, rootless Podman ({tasks} no-op tasks, {files} files)"
    return [_row(case, xs, ys, phases, floor_phases, failures)]


def _fila_as_user(*args: str) -> subprocess.CompletedProcess[bytes]:
    return run([sys.executable, "-c", "from fila.cli import main; main()", *args])


def as_user(argv: list[str]) -> None:
    """The user's side of per_task_podman (run by `rootless.User.py`, as the ordinary user):
    `image ROOT`: a queue root on Podman and `fila images build shell` in it;
    `prepare ROOT PROJECT N`: a queue root on Podman whose policy waives the limits rootless
    Podman cannot enforce and lists PROJECT, with N no-op tasks queued (not timed);
    `fila ROOT`: `fila run --once` on it, timed; prints the seconds;
    `floor JOBS PROJECT ROOT N`: N floor tasks with `podman run`; prints their steps as JSON."""
    from bench.filaside import allow_project, submit_noops
    from fila.core.layout import Root

    cmd, *rest = argv
    if cmd == "image":
        _fila_as_user("init", "--root", rest[0], "--backend", "podman")
        os.chdir(rest[0])  # `fila images build` takes the backend of the root it runs in
        _fila_as_user("images", "build", "shell")
    elif cmd == "prepare":
        root, project, n = Path(rest[0]), Path(rest[1]), int(rest[2])
        _fila_as_user("init", "--root", str(root), "--backend", "podman")
        r = Root.at(root)
        allow_project(r, project)
        pol = r.policies_dir / "default.json"
        pol.write_text(json.dumps(json.loads(pol.read_text()) | {"waive": WAIVED}, indent=1) + "\n")
        submit_noops(root, project, n)
    elif cmd == "fila":
        t = time.perf_counter()
        run([sys.executable, "-c", "from fila.cli import main; main()", "run", "--once", "--quiet",
             "--root", rest[0]], ok=(0, 1, 6))  # fmt: skip
        print(time.perf_counter() - t)
    elif cmd == "floor":
        from fila.sandbox.podman.service import service_conf

        jobs, project, root, n = Path(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3])
        # The engine configuration fila's own Podman service runs with (cgroupfs, runc on a
        # hybrid cgroup host): the floor's podman runs the same runtime the same way.
        os.environ["CONTAINERS_CONF"] = str(service_conf(jobs.parent / f"{jobs.name}.conf"))
        spec = FloorSpec(root)
        prepared = []
        for i in range(n):
            job = new_job(jobs, i)
            prepared.append((job, podman_run_args(spec.docker_args(job, f"fila-bench-{jobs.name}-{i}"))))
        sync()
        print(json.dumps([floor_task(project, job, args) for job, args in prepared]))
    else:
        raise SystemExit(f"bench.per_task.as_user: unknown command {cmd!r}")
