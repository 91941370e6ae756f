"""What every case shares: rows of the table, alternation, medians, temp dirs, commands."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One line of the results table. `ratio` is fila / baseline, the median of the ratios of the
    runs made side by side (see `paired_ratio`)."""

    case: str
    fila: float | None
    base: float | None
    unit: str
    target: str = ""  # e.g. "<= 1.25", "< 0.3 s"
    ok: bool | None = None  # None: no target, or not measured
    ratio: float | None = None
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    """Options and the one temp directory under which every case works."""

    tmp: Path
    quick: bool = False
    reps: int | None = None
    keep: bool = False
    throughput_files: int = 1
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)

    def reps_or(self, full: int, quick: int) -> int:
        if self.reps is not None:
            return self.reps
        return quick if self.quick else full

    def mkdtemp(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=self.tmp))


@contextmanager
def bench_tmp(keep: bool = False) -> Iterator[Path]:
    """The harness's temp directory (tempfile.mkdtemp: honours TMPDIR), removed at the end along
    with any container a case left behind under it."""
    top = Path(tempfile.mkdtemp(prefix="fila-bench-"))
    try:
        yield top
    finally:
        remove_containers_under(top)
        if keep:
            print(f"bench: kept {top}", file=sys.stderr)
        else:
            shutil.rmtree(top, ignore_errors=True)


def remove_containers_under(top: Path) -> None:
    """Force-remove containers whose fila.root label lies under `top` (ours, nobody else's)."""
    try:
        out = subprocess.run(
            [
                "docker",
                "ps",
                "-a",
                "--filter",
                "label=fila.root",
                "--format",
                '{{.ID}} {{.Label "fila.root"}}',
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    ids = [
        line.split(" ", 1)[0]
        for line in out.splitlines()
        if " " in line and line.split(" ", 1)[1].startswith(str(top))
    ]
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)


def fila_cmd() -> list[str]:
    """The `fila` console script of this interpreter's environment."""
    here = Path(sys.executable).parent / "fila"
    if here.exists():
        return [str(here)]
    found = shutil.which("fila")
    if found is None:
        raise SystemExit("bench: no `fila` command next to this python or on PATH")
    return [found]


def alternate(
    a: Callable[[], float],
    b: Callable[[], float],
    reps: int,
    *,
    warmup: int = 1,
) -> tuple[list[float], list[float]]:
    """Run A B A B ... `reps` times each after `warmup` discarded pairs; the two sample lists."""
    xs: list[float] = []
    ys: list[float] = []
    for i in range(warmup + reps):
        x, y = a(), b()
        if i >= warmup:
            xs.append(x)
            ys.append(y)
    return xs, ys


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of xs[i] / ys[i]: each fila run against the baseline run made right beside it.
    On a machine whose load drifts (a shared CI host) this is steadier than the ratio of the two
    medians, which can pair a fila run from a busy minute with a baseline run from a quiet one."""
    return statistics.median(x / y for x, y in zip(xs, ys, strict=True))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """subprocess.run that raises with the command's stderr when it fails."""
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.PIPE)
    ok = kw.pop("ok", (0,))
    p = subprocess.run(list(argv), check=False, **kw)
    if p.returncode not in ok:
        err = p.stderr.decode(errors="replace")[-2000:] if isinstance(p.stderr, bytes) else ""
        raise RuntimeError(f"{' '.join(map(str, argv))[:300]} exited {p.returncode}: {err}")
    return p


def run_rusage(argv: Sequence[str], **kw: Any) -> tuple[int, float, int]:
    """Run a command; (exit code, wall seconds, its peak RSS in KiB).

    The peak comes from GNU time when it is there: a child forked from this (large) Python
    process would otherwise report this process's RSS as its own (Linux keeps the pre-exec
    high-water mark in ru_maxrss)."""
    gnu_time = Path("/usr/bin/time")
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as out:
        full = [str(gnu_time), "-f", "%M", "-o", out.name, *argv] if gnu_time.exists() else argv
        t = time.perf_counter()
        p = subprocess.Popen(list(full), **kw)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        text = out.read().strip().splitlines()
    peak = int(text[-1]) if gnu_time.exists() and text and text[-1].isdigit() else ru.ru_maxrss
    return p.returncode, dt, peak


def peak_rss_kb() -> int:
    """This process's peak RSS in KiB (VmHWM: of its own address space, unlike ru_maxrss, which
    also counts what the parent had when it forked us)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def sync() -> None:
    """Write back dirty pages so one side's writes are not paid for by the other's run."""
    os.sync()
