"""`python -m bench`: run the cases, print the table, keep the numbers in bench/results/."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.common import REPO, Ctx, Row, bench_tmp


def _cases() -> dict[str, Callable[[Ctx], list[Row]]]:
    from bench.api_long import api_long
    from bench.ci_single import ci_single
    from bench.cycle_fake import cycle_fake
    from bench.engine_startup import engine_startup
    from bench.environment import environment
    from bench.large_project import large_project
    from bench.oneshot import oneshot_egress, oneshot_engine
    from bench.per_task import per_task
    from bench.pg_queue import pg_queue
    from bench.pg_task import pg_task
    from bench.queue_rate import queue_case
    from bench.runner_memory import runner_memory
    from bench.scale import scale
    from bench.startup import startup
    from bench.throughput import throughput
    from bench.web_list import web_list

    return {
        "per-task": per_task,
        "startup": startup,
        "throughput": throughput,
        "scale": scale,
        "queue": queue_case,
        "pg-queue": pg_queue,
        "pg-task": pg_task,
        "runner-memory": runner_memory,
        "cycle-fake": cycle_fake,
        "large-project": large_project,
        "ci-single": ci_single,
        "api-long": api_long,
        "engine-startup": engine_startup,
        "environment": environment,
        "web-list": web_list,
        "oneshot-engine": oneshot_engine,
        "oneshot-egress": oneshot_egress,
    }


CASES = (
    "per-task",
    "startup",
    "throughput",
    "scale",
    "queue",
    "pg-queue",
    "pg-task",
    "runner-memory",
    "cycle-fake",
    "large-project",
    "ci-single",
    "api-long",
    "engine-startup",
    "environment",
    "web-list",
    "oneshot-engine",
    "oneshot-egress",
)


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "MB" or unit.endswith("/min") or unit.endswith("/s"):
        return f"{v:,.1f} {unit}"
    if v < 0.01:
        return f"{v * 1000:.2f} ms"
    return f"{v:.3f} {unit}"


def table(rows: list[Row]) -> str:
    """The results as a Markdown table (it reads as well in a terminal)."""
    head = ["case", "fila (median)", "baseline (median)", "ratio", "target", "result"]
    lines = [head]
    for r in rows:
        result = "-" if r.ok is None else ("pass" if r.ok else "MISS")
        if r.fila is None and r.note:
            result = r.note
        lines.append(
            [
                r.case,
                _fmt(r.fila, r.unit),
                _fmt(r.base, r.unit),
                f"{r.ratio:.2f}" if r.ratio is not None else "-",
                r.target or "-",
                result,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def machine() -> dict[str, str]:
    """What the numbers were measured on."""

    def sh(*argv: str) -> str:
        try:
            return subprocess.run(
                argv, capture_output=True, text=True, timeout=30, check=False
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    return {
        "nproc": sh("nproc"),
        "cpu": cpu,
        "memory": next((line for line in sh("free", "-g").splitlines() if line.startswith("Mem:")), "?"),
        "kernel": platform.release(),
        "docker": sh(
            "docker",
            "info",
            "--format",
            "server {{.ServerVersion}}, storage driver {{.Driver}}, cgroup v{{.CgroupVersion}}",
        ),
        "python": platform.python_version(),
        "git": sh("git", "--version"),
        "filesystem": sh("df", "--output=fstype,source", tempfile.gettempdir()).splitlines()[-1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (fewer, smaller runs)")
    ap.add_argument("--only", default="", help=f"comma-separated cases: {', '.join(CASES)}")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions per side")
    ap.add_argument(
        "--throughput-files", type=int, default=1, help="files in the throughput case's target (default 1)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp directory")
    ap.add_argument(
        "--backend",
        choices=("docker", "podman"),
        default="docker",
        help="the container engine of the per-task case: podman runs it through rootless Podman as a "
        "throwaway ordinary user (as root; default docker)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench" / "results" / "latest.json",
        help="where to write the raw results (default: bench/results/latest.json)",
    )
    args = ap.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()] or list(CASES)
    unknown = set(only) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}")
    if args.backend != "docker" and set(only) != {"per-task"}:
        ap.error(f"--backend {args.backend} measures the per-task case only: add --only per-task")
    cases = _cases()
    if args.backend != "docker":
        per_task = cases["per-task"]
        cases["per-task"] = lambda ctx: per_task(ctx, backend=args.backend)  # type: ignore[call-arg]
    rows: list[Row] = []
    t0 = time.time()
    with bench_tmp(args.keep) as tmp:
        ctx = Ctx(
            tmp=tmp, quick=args.quick, reps=args.reps, keep=args.keep, throughput_files=args.throughput_files
        )
        for name in only:
            t, load = time.time(), os.getloadavg()[0]
            got = cases[name](ctx)
            load = max(load, os.getloadavg()[0])
            for r in got:
                r.extra["load"] = round(load, 2)
            rows += got
            ctx.log(f"{name}: done in {time.time() - t:.0f} s (1-minute load average up to {load:.1f})")
            for r in got:
                ctx.log(
                    f"  {r.case}: fila {_fmt(r.fila, r.unit)}, baseline {_fmt(r.base, r.unit)}"
                    + (f", ratio {r.ratio:.2f}" if r.ratio is not None else "")
                    + (f" ({r.note})" if r.note else "")
                )
    print(table(rows))
    for r in rows:
        if r.note:
            print(f"- {r.case}: {r.note}")
    info = machine()
    print("machine: " + "; ".join(f"{k} {v}" for k, v in info.items()))
    print(f"command: {' '.join(sys.argv)}; {time.time() - t0:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"machine": info, "argv": sys.argv, "quick": args.quick, "rows": [asdict(r) for r in rows]},
            indent=1,
        )
        + "\n"
    )
    return 0
