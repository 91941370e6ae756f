"""Case: large projects. Source-sized files (1-4 KB, no binaries) at 10,000 and 50,000
files; fila's prepare + diff on the overlay strategy against the floor's `cp -a` twice and
`git diff --no-index --binary`, run side by side (alternating), with the peak RSS of fila.

fila runs in a child process (`python -m bench.large_project child ...`, so its peak RSS is its
own) and measures, on one queue root:
- first task: the snapshot is built (one copy, hashed on the way) + the diff of the upper layer;
- later task: the project unchanged, so a stat pass finds the snapshot + the diff;
- a 4-engine group: four tasks on a fresh root's project state (the first builds, three reuse).
Between prepare and diff the same change as the scale case (bench/projects.py `mutate`) is made,
untimed, through a real kernel overlay of the job (mounted in a private mount namespace, as the
Docker daemon mounts the job's volume), so the diff reads a real upper layer. The floor makes the
same change in its work/ copy. Dirty pages are written back before each timed phase.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, Ctx, Row, alternate, median, paired_ratio, run_rusage, sync
from bench.filaside import allow_project, init_root
from bench.floor import copy_in, new_job
from bench.projects import make_project, mutate

LATER_TARGET_S = 1.0
LATER_TARGET_RATIO = 0.05
FIRST_TARGET = 1.0
GROUP = 4


def large_project(ctx: Ctx) -> list[Row]:
    sizes = [10_000] if ctx.quick else [10_000, 50_000]
    rows: list[Row] = []
    for size in sizes:
        rows += _one_size(ctx, size, reps=ctx.reps_or(3 if size <= 10_000 else 2, 1))
    return rows


def _one_size(ctx: Ctx, size: int, reps: int) -> list[Row]:
    base = ctx.mkdtemp(f"large{size}")
    ctx.log(f"large-project: generating {size} source-sized files")
    proj = make_project(base / "p", size - 1, seed=size, binary_every=0, text_bytes=(1024, 4096))
    files_json = base / "files.json"
    files_json.write_text(json.dumps(proj.files))
    # A project at rest: stat data younger than the racy window (2 s) is never trusted, and a
    # freshly generated project would have every file read again by the next task.
    time.sleep(2.5)
    fila_runs: list[dict] = []
    floor_runs: list[dict] = []
    n = [0]

    def fila_side() -> float:
        n[0] += 1
        root = init_root(base / f"root{n[0]}")
        _allow(root, proj.path)
        sync()
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.large_project",
                "child",
                str(root),
                str(proj.path),
                str(files_json),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        if p.returncode != 0:
            raise RuntimeError(f"bench.large_project child failed: {p.stderr[-3000:]}")
        out = json.loads(p.stdout)
        fila_runs.append(out)
        shutil.rmtree(root, ignore_errors=True)
        return out["first"]["total"]

    def floor_side() -> float:
        jobs = base / "floor"
        job = new_job(jobs, n[0])
        sync()
        t = time.perf_counter()
        copy_in(proj.path, job)
        copy_s = time.perf_counter() - t
        mutate(job / "work", proj.files)
        sync()
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
        with open(job / "DIFF.patch", "wb") as out:
            rc, diff_s, _rss = run_rusage(
                ["git", "diff", "--no-index", "--binary", "input", "work"], cwd=job, stdout=out, env=env
            )
        if rc not in (0, 1):
            raise RuntimeError(f"git diff --no-index exited {rc}")
        floor_runs.append({"copy": copy_s, "diff": diff_s, "total": copy_s + diff_s})
        shutil.rmtree(jobs, ignore_errors=True)
        return copy_s + diff_s

    ctx.log(f"large-project {size}: {reps} x (fila child: first, later, {GROUP}-task group; floor task)")
    first, floor = alternate(fila_side, floor_side, reps)
    runs, fruns = fila_runs[-reps:], floor_runs[-reps:]
    later = [r["later"]["total"] for r in runs]
    group = [r["group"]["total"] for r in runs]
    rss_mb = max(r["rss_kb"] for r in runs) / 1024
    fl = median(floor)

    def med(key: str, sub: str) -> float:
        return statistics.median(r[key][sub] for r in runs)

    common = f"{size} files, {proj.bytes / 1e6:.0f} MB"
    floor_note = (
        f"floor: cp x2 {statistics.median(r['copy'] for r in fruns):.2f} s, "
        f"git diff {statistics.median(r['diff'] for r in fruns):.2f} s"
    )
    later_ratio = paired_ratio(later, floor)
    return [
        Row(
            f"large project, first task ({common})",
            median(first),
            fl,
            "s",
            target=f"<= {FIRST_TARGET}",
            ok=paired_ratio(first, floor) <= FIRST_TARGET,
            ratio=paired_ratio(first, floor),
            note=f"fila: snapshot {med('first', 'prepare'):.2f} s, diff {med('first', 'diff'):.3f} s; "
            f"{floor_note}; fila peak RSS {rss_mb:.0f} MB",
            samples={"fila": first, "floor": floor},
            extra={"fila": runs, "floor": fruns},
        ),
        Row(
            f"large project, later task ({common})",
            median(later),
            fl,
            "s",
            target=f"< {LATER_TARGET_S:g} s and <= {LATER_TARGET_RATIO}",
            ok=median(later) < LATER_TARGET_S and later_ratio <= LATER_TARGET_RATIO,
            ratio=later_ratio,
            note=f"fila: stat pass {med('later', 'prepare'):.3f} s, diff {med('later', 'diff'):.3f} s "
            f"({runs[-1]['later']['how']}, {runs[-1]['later']['read']} files read)",
            samples={"fila": later, "floor": floor},
        ),
        Row(
            f"large project, {GROUP}-engine group ({common})",
            median(group),
            GROUP * fl,
            "s",
            ratio=paired_ratio(group, [GROUP * f for f in floor]),
            note=f"fila: {GROUP} tasks on one snapshot ({', '.join(runs[-1]['group']['hows'])}); "
            f"floor: {GROUP} x its task",
            samples={"fila": group, "floor": [GROUP * f for f in floor]},
        ),
    ]


def _allow(root: Path, project: Path) -> None:
    """The root's default policy names the project and holds 50,000 files: max_work_files counts
    directories too, and the default (50,000) is just short of that."""
    from fila.core.layout import Root

    r = Root.at(root)
    allow_project(r, project)
    path = r.policies_dir / "default.json"
    data = json.loads(path.read_text())
    data["max_work_files"] = 200_000
    path.write_text(json.dumps(data, indent=1) + "\n")


# --- the fila process ----------------------------------------------------------------------------


def _engine_change(overlay: object, files_json: str) -> None:
    """`mutate` through a real overlay of the job (untimed): the upper layer is what the kernel
    leaves, whiteout and all. Real root mounts in a private mount namespace; anyone else in a
    user namespace (the `userxattr` option is what lets both read the marks later)."""
    merged = Path(overlay.upper).parent / "merged"  # type: ignore[attr-defined]
    merged.mkdir(exist_ok=True)
    code = (
        "import json, sys; from pathlib import Path; from bench.projects import mutate; "
        "mutate(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))"
    )
    ns = ["unshare", "-m"] if os.getuid() == 0 else ["unshare", "-Urm"]
    script = f'mount -t overlay overlay -o "$1" "$2" && {sys.executable} -c "$3" "$2" "$4" && umount "$2"'
    p = subprocess.run(
        [*ns, "sh", "-c", script, "sh", overlay.volume("/job/work").options(), str(merged), code, files_json],  # type: ignore[attr-defined]
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the overlay change failed: {p.stderr[-2000:]}")
    merged.rmdir()


def _task(root_dir: str, project: str, tid: str, files_json: str) -> dict:
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.run import job as cycle
    from fila.sandbox.base import run_as
    from fila.workspace import diff, jobdir
    from fila.workspace.overlay import prepare_job

    root = Root.at(root_dir)
    task = Task(id=tid, engine="shell", command="true", targets=["."], project=project)
    checked = cycle.check_task(root, task)
    owner = run_as() if os.getuid() == 0 else None
    sync()
    t = time.perf_counter()
    prep, overlay, snap = prepare_job(root, tid, task, checked.policy, checked.effective, owner=owner)
    prepare_s = time.perf_counter() - t
    _engine_change(overlay, files_json)
    sync()
    t = time.perf_counter()
    d = diff.compute_diff(
        prep.job_dir,
        policy=checked.policy,
        scratch=root.meta(tid) / "scratch",
        skip=jobdir.diff_skip(root, checked.project, checked.policy),
        layers=overlay.layers(),
    )
    diff_s = time.perf_counter() - t
    return {
        "prepare": prepare_s,
        "diff": diff_s,
        "total": prepare_s + diff_s,
        "how": snap.how,
        "read": snap.hashed,
        "files": snap.files,
        "diff_files": d.stat.files,
        "patch_bytes": d.bytes,
    }


def child(root_dir: str, project: str, files_json: str) -> dict:
    from bench.common import peak_rss_kb

    first = _task(root_dir, project, "first", files_json)
    later = _task(root_dir, project, "later", files_json)
    # The group: a fresh root (no snapshot yet), GROUP tasks on the same state.
    groot = Path(root_dir + "-group")
    init_root(groot)
    _allow(groot, Path(project))
    members = [_task(str(groot), project, f"g{i}", files_json) for i in range(GROUP)]
    shutil.rmtree(groot, ignore_errors=True)
    return {
        "first": first,
        "later": later,
        "group": {"total": sum(m["total"] for m in members), "hows": [m["how"] for m in members]},
        "rss_kb": peak_rss_kb(),
    }


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        print(json.dumps(child(*sys.argv[2:5])))
    else:
        raise SystemExit("usage: python -m bench.large_project child ROOT PROJECT FILES_JSON")
