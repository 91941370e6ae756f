"""Case 2: start-up. Wall time of `fila --help` and of `fila submit`, next to the interpreter
starting and doing nothing (`python -c pass`), the part no Python CLI can avoid."""

from __future__ import annotations

import sys
import time
from itertools import count

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio, run
from bench.filaside import init_root

HELP_TARGET_S = 0.3


def startup(ctx: Ctx) -> list[Row]:
    reps = ctx.reps_or(15, 3)
    fila = fila_cmd()
    floor = [sys.executable, "-c", "pass"]

    def wall(argv: list[str]) -> float:
        t = time.perf_counter()
        run(argv)
        return time.perf_counter() - t

    ctx.log(f"startup: {reps} x `fila --help` and `fila submit` a side, alternating")
    hx, hy = alternate(lambda: wall([*fila, "--help"]), lambda: wall(floor), reps)
    root = init_root(ctx.mkdtemp("startup-root"))
    (root / "greeting.txt").write_text("hello\n")
    ids = count()
    sx, sy = alternate(
        lambda: wall(
            [
                *fila,
                "submit",
                "--root",
                str(root),
                "--engine",
                "shell",
                "--command",
                "true",
                "--target",
                "greeting.txt",
                "--id",
                f"s{next(ids)}",
            ]
        ),
        lambda: wall(floor),
        reps,
    )
    h = median(hx)
    return [
        Row(
            "start-up: fila --help",
            h,
            median(hy),
            "s",
            target=f"< {HELP_TARGET_S} s",
            ok=h < HELP_TARGET_S,
            ratio=paired_ratio(hx, hy),
            samples={"fila": hx, "floor": hy},
            note="baseline: python -c pass",
        ),
        Row(
            "start-up: fila submit",
            median(sx),
            median(sy),
            "s",
            ratio=paired_ratio(sx, sy),
            samples={"fila": sx, "floor": sy},
            note="baseline: python -c pass",
        ),
    ]
