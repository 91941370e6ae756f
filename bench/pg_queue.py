"""Case "pg-queue": the PostgreSQL queue alone (docs/scale-out.md), no container: 1, 4 and 8
runner processes drain one database, beside the file queue drained by as many processes.

Each process is a runner's claim loop without the run: the PostgreSQL side calls `claim` (one
statement, `FOR UPDATE SKIP LOCKED`, a new fencing token, the running record and the `claimed`
event, one transaction) until it gets nothing; the file side calls `next_claim` (the worker's
claim: the rename into run/ and its fsyncs) as long. Rows: tasks per second (the tasks over the
wall time from the first claim to the last) and the claim's latency p50 and p99 over every claim
of the run. The database is a throwaway cluster on a unix socket (tests/support/pg.py: Debian's
server binaries), on this machine's disk, with PostgreSQL's default fsync and synchronous_commit.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Ctx, Row, median

PROCS = (1, 4, 8)


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def _pg_drain(url: str, name: str, start: Any, out: Any) -> None:
    from fila.queue.pg.store import PgQueue

    lat: list[float] = []
    with PgQueue(url) as q:
        start.wait()
        while True:
            t = time.perf_counter()
            lease = q.claim(name, ["shell"], 60.0)
            lat.append(time.perf_counter() - t)
            if lease is None:
                break
    out.put((time.perf_counter(), lat[:-1]))


def _file_drain(root_path: str, start: Any, out: Any) -> None:
    from fila.core.layout import Root
    from fila.queue import store as queue
    from fila.run import job as cycle

    root, worker, lat = Root.at(root_path), queue.new_worker_id(), []
    start.wait()
    while True:
        t = time.perf_counter()
        claim = cycle.next_claim(root, worker)
        lat.append(time.perf_counter() - t)
        if claim is None:
            break
    out.put((time.perf_counter(), lat[:-1]))


def _drain(target: Any, args: list[tuple[Any, ...]]) -> tuple[float, list[float]]:
    """One process per `args` entry running `target(*args, start, out)`, released together:
    (wall s, claim latencies)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=target, args=(*a, start, out)) for a in args]
    for p in ps:
        p.start()
    time.sleep(1.0 + 0.2 * len(ps))  # every process imported and connected before the start
    t0 = time.perf_counter()
    start.set()
    ends, lat = [], []
    for _ in ps:
        end, xs = out.get(timeout=300)  # a process that died: queue.Empty, not a hang
        ends.append(end)
        lat += xs
    for p in ps:
        p.join(30)
    return max(ends) - t0, lat


def pg_side(cluster: Any, n: int, procs: int) -> tuple[float, list[float]]:
    from fila.core.models import Task
    from fila.queue.pg import migrate
    from fila.queue.pg.store import PgQueue

    url = cluster.new_database()
    migrate.migrate(url)
    with PgQueue(url) as q:
        for i in range(n):
            q.enqueue(f"q{i:06d}", Task(engine="shell", command="true", targets=["."]), notify=False)
    wall, lat = _drain(_pg_drain, [(url, f"runner-{i}") for i in range(procs)])
    with PgQueue(url) as q:
        left = q.counts().get("queued", {})
    if left:
        raise RuntimeError(f"bench: {left} tasks left queued")
    return wall, lat


def file_side(tmp: Path, n: int, procs: int) -> tuple[float, list[float]]:
    from bench.queue_rate import _fila_root
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.queue import store as queue

    base = Path(tempfile.mkdtemp(prefix="fileq-", dir=tmp))
    try:
        root = Root.at(_fila_root(base))
        for i in range(n):
            queue.enqueue(root, f"q{i:06d}", Task(engine="shell", command="true", targets=["."]))
        wall, lat = _drain(_file_drain, [(str(root.path),)] * procs)
        left = list(root.in_dir.iterdir())
        if left:
            raise RuntimeError(f"bench: {len(left)} tasks left in fila/in")
        return wall, lat
    finally:
        shutil.rmtree(base, ignore_errors=True)


def measure(tmp: Path, n: int, reps: int, procs: tuple[int, ...] = PROCS) -> list[Row]:
    """Rows per process count: tasks/s (PostgreSQL vs the file queue), claim p50 and p99."""
    from tests.support.pg import cluster

    rows = []
    with cluster() as c:
        for k in procs:
            pg = [pg_side(c, n, k) for _ in range(reps)]
            fq = [file_side(tmp, n, k) for _ in range(reps)]
            pg_rate, fq_rate = [n / w for w, _ in pg], [n / w for w, _ in fq]
            pg_lat = [x for _, xs in pg for x in xs]
            fq_lat = [x for _, xs in fq for x in xs]
            rows.append(
                Row(
                    f"pg queue, {k} runner process{'es' if k > 1 else ''} ({n} tasks; baseline: file queue)",
                    median(pg_rate),
                    median(fq_rate),
                    "tasks/s",
                    ratio=median(pg_rate) / median(fq_rate),
                    note=f"claim vs next_claim, {reps} run(s)",
                    samples={"fila": pg_rate, "floor": fq_rate},
                )
            )
            for p in (0.5, 0.99):
                rows.append(
                    Row(
                        f"pg queue claim p{int(p * 100)}, {k} process{'es' if k > 1 else ''} "
                        "(baseline: file queue)",
                        _pct(pg_lat, p),
                        _pct(fq_lat, p),
                        "s",
                        ratio=_pct(pg_lat, p) / _pct(fq_lat, p),
                        note=f"over {len(pg_lat)} claims",
                    )
                )
    return rows


def pg_queue(ctx: Ctx) -> list[Row]:
    n = 200 if ctx.quick else 2000
    reps = ctx.reps_or(3, 1)
    ctx.log(f"pg-queue: {n} tasks drained by {', '.join(map(str, PROCS))} processes, {reps} run(s) a side")
    return measure(ctx.tmp, n, reps)
