"""Case api-long: one task at a time through the Python API in one long-lived process (issue 38),
against the floor, beside `fila submit --run` (a fresh process per task).

A program that keeps one `fila.Client` (api/client.py) pays no process start-up, no imports and
no new container-engine client per task: what is left is fila's own work, claim to record. Three
sides alternate in one run, each the same `sed` on one file of the same 100-file project:

- floor: ci_single's (cp -a twice, `docker run --rm` derived from fila's create_kwargs, chown as
  root, `git diff --no-index`);
- api: `client.submit(...)` then `client.run([id])` in this process, one client and one queue root
  for every round (its records pile up, as a long-lived program's do);
- submit --run: `fila submit ... --run --json`, a process per task, a fresh root each.

The ratio is paired (each side's round against the floor's beside it): the machine is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from itertools import count
from pathlib import Path

from bench.ci_single import SED, floor_round
from bench.common import Ctx, Row, fila_cmd, median, paired_ratio, run, sync
from bench.filaside import allow_project, ensure_image, init_root
from bench.floor import FloorSpec
from bench.projects import make_project

TARGET = 1.1  # x the floor: per task through the API in a long-lived process


def api_long(ctx: Ctx, *, files: int = 100) -> list[Row]:
    import fila
    from fila.core.layout import Root

    ensure_image()
    reps = ctx.reps_or(9, 2)
    project = make_project(ctx.mkdtemp("api-project") / "p", files, seed=3).path
    target = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())[0]
    sed = SED.replace("f0000.txt", target)
    spec = FloorSpec(init_root(ctx.mkdtemp("api-floor-root")), command=sed)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    ids = count()
    phases: dict[str, dict[str, list[float]]] = {"api": {}, "one": {}, "floor": {}}
    failed: list[str] = []

    def fresh_root() -> Path:
        root = init_root(ctx.mkdtemp("api-root"))
        allow_project(Root.at(root), project)
        return root

    def keep(side: str, status: str, timings: dict[str, float], wall: float) -> None:
        if status != "needs_review":
            failed.append(f"{side}: {status}")
            return
        for k, v in {**timings, "wall": wall}.items():
            phases[side].setdefault(k, []).append(v)

    api_root = fresh_root()
    client = fila.Client(api_root)

    def api_side() -> float:
        sync()
        t = time.perf_counter()
        rec = client.submit(
            engine="shell", command=sed, targets=["."], project=str(project), id=f"api{next(ids)}"
        )
        done = client.run([rec.id])
        dt = time.perf_counter() - t
        [got] = done.records or [client.record(rec.id)]
        keep("api", got.status.value, got.timings, dt)
        return dt

    def one_process() -> float:
        root = fresh_root()
        argv = [*fila_cmd(), "submit", "--root", str(root), "--engine", "shell", "--command", sed, "--target",
                ".", "--project", str(project), "--run", "--json", "--quiet"]  # fmt: skip
        sync()
        t = time.perf_counter()
        p = run(argv, stdout=-1, ok=(0, 1), env=env)
        dt = time.perf_counter() - t
        doc = json.loads(p.stdout.decode().splitlines()[0]) if p.stdout.strip() else {}
        keep("one", str(doc.get("status")), doc.get("timings", {}), dt)
        shutil.rmtree(root, ignore_errors=True)
        return dt

    def floor_side() -> float:
        return floor_round(ctx, spec, project, phases["floor"])

    ctx.log(f"api-long: {reps} x (floor, API in this process, submit --run), alternating")
    fl: list[float] = []
    api: list[float] = []
    one: list[float] = []
    try:
        for i in range(reps + 1):  # the first round warms the page cache, the daemon and the client
            f, a, o = floor_side(), api_side(), one_process()
            if i:
                fl.append(f)
                api.append(a)
                one.append(o)
    finally:
        client.close()
        shutil.rmtree(api_root, ignore_errors=True)
    breakdown = {
        side: {k: round(statistics.median(v), 4) for k, v in got.items()} for side, got in phases.items()
    }
    note = f"FAILED {len(failed)}: {failed[0]}" if failed else ""
    r_api, r_one = paired_ratio(api, fl), paired_ratio(one, fl)
    return [
        Row(
            "api-long: per task, one Client in a long-lived process",
            median(api),
            median(fl),
            "s",
            target=f"<= {TARGET}",
            ok=r_api <= TARGET and not failed,
            ratio=r_api,
            note=note,
            samples={"api": api, "floor": fl},
            extra=breakdown,
        ),
        Row(
            "api-long: submit --run beside it (a process per task)",
            median(one),
            median(fl),
            "s",
            ratio=r_one,
            note=note,
            samples={"submit --run": one, "floor": fl},
        ),
    ]
