"""Case 5: the file queue alone, without Docker, with its fsyncs: submit and claim rates.

fila's side is `queue.enqueue` (record, event line, task file; each durable) and the worker's
claim (`cycle.next_claim`: look at in/, read the record, rename into run/, log the event). The
baseline is the least a durable file queue can do: one file written durably (temp file, fsync,
rename, fsync of the directory) per submit, one rename plus fsync of both directories per claim.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import Ctx, Row, alternate, median, paired_ratio


@contextmanager
def count_fsyncs() -> Iterator[list[int]]:
    """Count os.fsync calls in this process while the block runs."""
    box = [0]
    real = os.fsync

    def counting(fd: int) -> None:
        box[0] += 1
        real(fd)

    os.fsync = counting  # type: ignore[assignment]
    try:
        yield box
    finally:
        os.fsync = real


def _fila_root(base: Path) -> Path:
    from fila.core.layout import Root

    r = Root.at(base)
    for d in r.all_dirs():
        d.mkdir(parents=True, exist_ok=True)
    return base


def fila_queue(base: Path, n: int) -> tuple[float, float, int, int]:
    """Submit `n` tasks, then claim them all. (submit s, claim s, fsyncs/submit, fsyncs/claim)."""
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.queue import store as queue
    from fila.run import job as cycle

    root = Root.at(_fila_root(base))
    tasks = [Task(engine="shell", command="true", targets=["."], prompt=f"no-op {i}") for i in range(n)]
    with count_fsyncs() as fs:
        t = time.perf_counter()
        for i, task in enumerate(tasks):
            queue.enqueue(root, f"q{i:06d}", task)
        submit_s = time.perf_counter() - t
    submit_fsyncs = fs[0]
    worker = queue.new_worker_id()
    got = 0
    with count_fsyncs() as fs:
        t = time.perf_counter()
        while cycle.next_claim(root, worker) is not None:
            got += 1
        claim_s = time.perf_counter() - t
    if got != n:
        raise RuntimeError(f"bench: claimed {got} of {n} tasks")
    return submit_s, claim_s, submit_fsyncs // n, fs[0] // n


def floor_queue(base: Path, n: int) -> tuple[float, float]:
    """The least a durable file queue does: (submit s, claim s) for `n` tasks."""
    inq, run = base / "in", base / "run"
    inq.mkdir(parents=True)
    run.mkdir()
    body = b'{"engine": "shell", "command": "true", "targets": ["."]}\n'

    def fsync_dir(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    for i in range(n):
        fd, tmp = tempfile.mkstemp(dir=inq, prefix=".tmp")
        os.write(fd, body)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, inq / f"q{i:06d}.json")
        fsync_dir(inq)
    submit_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n):
        os.rename(inq / f"q{i:06d}.json", run / f"q{i:06d}.json")
        fsync_dir(run)
        fsync_dir(inq)
    return submit_s, time.perf_counter() - t


def measure(tmp: Path, n: int, reps: int) -> list[Row]:
    """The queue rows for `n` tasks, `reps` alternating runs a side (usable without Docker)."""
    fila: list[tuple[float, float, int, int]] = []
    floor: list[tuple[float, float]] = []

    def side(fn: Callable[[Path], object], out: list) -> Callable[[], float]:
        def go() -> float:
            base = Path(tempfile.mkdtemp(prefix="queue-", dir=tmp))
            try:
                out.append(fn(base))
            finally:
                shutil.rmtree(base, ignore_errors=True)
            return 0.0

        return go

    alternate(
        side(lambda b: fila_queue(b, n), fila), side(lambda b: floor_queue(b, n), floor), reps, warmup=0
    )
    sub_fs, sub_bs = [n / x[0] for x in fila], [n / x[0] for x in floor]
    clm_fs, clm_bs = [n / x[1] for x in fila], [n / x[1] for x in floor]
    sub_f, sub_b, clm_f, clm_b = median(sub_fs), median(sub_bs), median(clm_fs), median(clm_bs)
    fs_sub, fs_clm = fila[-1][2], fila[-1][3]
    return [
        Row(
            f"queue submit ({n} tasks, no Docker)",
            sub_f,
            sub_b,
            "tasks/s",
            ratio=paired_ratio(sub_fs, sub_bs),
            note=f"{fs_sub} fsyncs per submit (floor: 2)",
            samples={"fila": sub_fs, "floor": sub_bs},
        ),
        Row(
            f"queue claim ({n} tasks, no Docker)",
            clm_f,
            clm_b,
            "tasks/s",
            ratio=paired_ratio(clm_fs, clm_bs),
            note=f"{fs_clm} fsyncs per claim (floor: 2)",
            samples={"fila": clm_fs, "floor": clm_bs},
        ),
    ]


def queue_case(ctx: Ctx) -> list[Row]:
    n = 100 if ctx.quick else 1000
    reps = ctx.reps_or(5, 2)
    ctx.log(f"queue: {reps} x ({n} submits + {n} claims) a side, alternating")
    return measure(ctx.tmp, n, reps)
