"""Case 4: scale. Targets of 1,000 and 10,000 files (about 20 and 200 MB, one file in ten
binary): fila's prepare and diff against `cp -a` twice and `git diff --no-index --binary`, and the
peak memory of the fila process. No container runs: between prepare and diff the same change
(bench/projects.py `mutate`) is made in work/ on both sides, untimed, and dirty pages are written
back before each timed phase."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from bench.common import REPO, Ctx, Row, alternate, median, paired_ratio, run_rusage, sync
from bench.filaside import init_root
from bench.floor import copy_in, new_job
from bench.projects import make_project, mutate

TARGET = 1.5
MEM_TARGET_MB = 150


def scale(ctx: Ctx) -> list[Row]:
    sizes = [1000] if ctx.quick else [1000, 10000]
    rows: list[Row] = []
    for size in sizes:
        rows += _one_size(ctx, size, reps=ctx.reps_or(7 if size <= 1000 else 3, 1))
    return rows


def _one_size(ctx: Ctx, size: int, reps: int) -> list[Row]:
    base = ctx.mkdtemp(f"scale{size}")
    ctx.log(f"scale: generating {size} files")
    proj = make_project(base / "p", size - 1, seed=size)
    files_json = base / "files.json"
    files_json.write_text(json.dumps(proj.files))
    root = init_root(base / "root")
    fila_runs: list[dict] = []
    floor_runs: list[dict] = []
    n = [0]

    def fila_side() -> float:
        n[0] += 1
        tid = f"s{n[0]}"
        sync()
        p = subprocess.run(
            [sys.executable, "-m", "bench.scale_child", str(root), str(proj.path), tid, str(files_json)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        if p.returncode != 0:
            raise RuntimeError(f"bench.scale_child failed: {p.stderr[-3000:]}")
        out = json.loads(p.stdout)
        fila_runs.append(out)
        shutil.rmtree(root / "sandbox" / "jobs" / tid, ignore_errors=True)
        shutil.rmtree(root / "sandbox" / "meta" / tid, ignore_errors=True)
        return out["prepare"] + out["diff"]

    def floor_side() -> float:
        jobs = base / "floor"
        job = new_job(jobs, n[0])
        sync()
        t = time.perf_counter()
        copy_in(proj.path, job)
        copy_s = time.perf_counter() - t
        mutate(job / "work", proj.files)
        sync()
        with open(job / "DIFF.patch", "wb") as out:
            rc, diff_s, rss = run_rusage(
                ["git", "diff", "--no-index", "--binary", "input", "work"], cwd=job, stdout=out
            )
        if rc not in (0, 1):
            raise RuntimeError(f"git diff --no-index exited {rc}")
        floor_runs.append(
            {
                "prepare": copy_s,
                "diff": diff_s,
                "rss_kb": rss,
                "patch_bytes": (job / "DIFF.patch").stat().st_size,
            }
        )
        shutil.rmtree(jobs, ignore_errors=True)
        return copy_s + diff_s

    mb = proj.bytes / 1e6
    ctx.log(f"scale: {size} files ({mb:.0f} MB), {reps} x prepare+diff a side, alternating")
    xs, ys = alternate(fila_side, floor_side, reps)
    fr, br = fila_runs[-reps:], floor_runs[-reps:]
    what = f"{size:,} files, {mb:.0f} MB"

    def med(runs: list[dict], key: str) -> float:
        return median([r[key] for r in runs])

    f, b = median(xs), median(ys)
    last = fr[-1]
    rows = [
        Row(
            f"scale {what}: prepare (vs cp -a x2)",
            med(fr, "prepare"),
            med(br, "prepare"),
            "s",
            ratio=paired_ratio([r["prepare"] for r in fr], [r["prepare"] for r in br]),
        ),
        Row(
            f"scale {what}: diff (vs git diff --no-index)",
            med(fr, "diff"),
            med(br, "diff"),
            "s",
            ratio=paired_ratio([r["diff"] for r in fr], [r["diff"] for r in br]),
            note=f"{last['diff_files']} paths changed; patch {last['patch_bytes']:,} bytes "
            f"(git's: {br[-1]['patch_bytes']:,})",
        ),
        Row(
            f"scale {what}: prepare + diff",
            f,
            b,
            "s",
            target=f"<= {TARGET}",
            ok=paired_ratio(xs, ys) <= TARGET,
            ratio=paired_ratio(xs, ys),
            samples={"fila": xs, "floor": ys},
        ),
    ]
    rss = max(r["rss_kb"] for r in fr) / 1024
    git_rss = max(r["rss_kb"] for r in br) / 1024
    rows.append(
        Row(
            f"scale {what}: peak RSS of the fila process",
            rss,
            git_rss,
            "MB",
            target=f"< {MEM_TARGET_MB} MB" if size >= 10000 else "",
            ok=rss < MEM_TARGET_MB if size >= 10000 else None,
            note="baseline: git diff --no-index",
        )
    )
    shutil.rmtree(base, ignore_errors=True)
    return rows
