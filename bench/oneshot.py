"""The one-shot path: what a CI job pays, one fresh `fila submit --run` process per task, nothing
warm (no worker, no spare gateway made beforehand).

Two cases, each side a fresh process timed from its start to its exit, alternating after one
discarded round, the ratio the median of the paired ratios (docs/benchmarks.md, "The one-shot
path"):

- `oneshot-engine`: a real engine (claude by default) through `fila submit --run` under its
  `network: allowlist` policy, its model route through the job's gateway to the tests' scripted
  model server (tests/upstreams), against the same CLI in a bare hardened `docker run` pointed
  straight at the server (bench/engine_startup.py's floor). Target: 1.3x.
- `oneshot-egress`: the same no-op task (the shell engine running `true`) by `fila submit --run`
  under a `network: allowlist` policy (one route, never called; the egress network an internal
  one of the bench's own) and under `network: none`. Target: +0.5 s at most.

A side's time ends at its process's exit, which is what a CI step waits for; the reaper it leaves
its gateway's removal to (sandbox/docker/reap.py) is waited for off the clock before the next side,
so that no side shares the machine with another's teardown.

`FILA_BENCH_BEFORE=DIR` (another checkout's `src/`) adds that tree's `fila submit --run` as one
more side of the same alternation: a before/after under one load.

`--timeline` runs one more round of each fila side while `docker events` is read, and prints
when each of its containers and job networks was created, started, died and destroyed, in
seconds from the process's start, beside the record's timings (docs/benchmarks.md, "Where the time
goes").

    .venv/bin/python -m bench.oneshot [--reps N] [--engines claude] [--only engine|egress] [--timeline]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Ctx, Row, fila_cmd, median, paired_ratio

ENGINE_TARGET = 1.3  # x the bare CLI
EGRESS_TARGET_S = 0.5  # seconds added to a no-op task by `network: allowlist`
RUN_TIMEOUT_S = 300


def _before_cmd() -> tuple[list[str], dict[str, str]] | None:
    """FILA_BENCH_BEFORE's `fila` and the PYTHONPATH that selects its tree, or None."""
    before = os.environ.get("FILA_BENCH_BEFORE")
    if not before:
        return None
    cmd = [
        sys.executable,
        "-c",
        "import sys; sys.argv[0] = 'fila'; from fila.entry import main; sys.exit(main())",
    ]
    return cmd, {"PYTHONPATH": before}


def _env(extra: dict[str, str]) -> dict[str, str]:
    """An installed fila's environment: bytecode written once, never recompiled (bench/ci_single.py)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | extra


def _one_shot(cmd: list[str], argv: list[str], env: dict[str, str], records: list[dict[str, Any]]) -> float:
    """Wall seconds of one `fila submit ... --run --json`, its record kept; a task that does not
    end in needs_review stops the bench."""
    t = time.perf_counter()
    p = subprocess.run([*cmd, *argv, "--run"], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - t
    try:
        rec = json.loads(p.stdout)
    except ValueError:
        raise RuntimeError(f"`fila submit --run` exited {p.returncode}: {p.stderr[-1500:]}") from None
    if rec.get("status") != "needs_review":
        raise RuntimeError(f"one-shot task ended {rec.get('status')}: {rec.get('error')}")
    records.append(rec)
    _settle(Path(argv[argv.index("--root") + 1]))
    return wall


def _settle(root: Path) -> None:
    """Wait, off the clock, until the reaper a one-shot left (sandbox/docker/reap.py) has removed
    its gateway: the next side does not share the machine with this one's teardown."""
    from tests.support.containers import reaped

    reaped(root / "sandbox" / "spares")


def rounds(sides: dict[str, Callable[[], float]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Every side once per round, in turn, `reps` rounds after `warmup` discarded ones."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + reps):
        for name, side in sides.items():
            v = side()
            if i >= warmup:
                out[name].append(v)
    return out


def _gateway_parts(records: list[dict[str, Any]], reps: int) -> str:
    parts: dict[str, list[float]] = {}
    for rec in records[-reps:]:
        for k, v in (rec.get("timings") or {}).items():
            if k.startswith("gateway_") or k in ("startup", "create", "start_wait"):
                parts.setdefault(k, []).append(v)
    return ", ".join(f"{k} {median(v):.3f}" for k, v in sorted(parts.items()))


def _paired(case: str, xs: list[float], ys: list[float], note: str, **kw: Any) -> Row:
    """A row of two sides' wall times side by side: their medians and the median of paired ratios."""
    return Row(case, median(xs), median(ys), "s", ratio=paired_ratio(xs, ys), note=note, **kw)


def _image_id() -> str:
    """The gateway image's id now: other work on a shared machine may rebuild it mid-run (its
    definition differs there), which makes the rounds after that measure another gateway."""
    from fila.egress.config import GATEWAY_IMAGE

    p = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", GATEWAY_IMAGE],
                       capture_output=True, text=True, check=False)  # fmt: skip
    return p.stdout.strip()


def _same_image(before: str) -> str:
    """A note for the row when the gateway image changed during its rounds."""
    now = _image_id()
    if now == before:
        return ""
    return f"; THE GATEWAY IMAGE CHANGED DURING THE ROUNDS ({before[:19]} -> {now[:19]})"


def timeline(side: Callable[[], float], records: list[dict[str, Any]], root: Path) -> list[str]:
    """One more run of `side` while the daemon's events are read: its containers' (labelled with
    `root`) and job networks' events, seconds from the run's start, then its record's timings."""
    ev = subprocess.Popen(["docker", "events", "--format", "{{json .}}"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)  # the stream is open before the run starts
        t0 = time.time()
        wall = side()
        time.sleep(0.5)  # the last removals' events arrive
    finally:
        ev.terminate()
        out = ev.communicate(timeout=30)[0]
    lines = [f"wall {wall:.3f} s; timings {json.dumps(records[-1].get('timings'))}"]
    for raw in out.splitlines():
        e = json.loads(raw)
        attrs = e.get("Actor", {}).get("Attributes", {})
        name = attrs.get("name", "")
        if e.get("Type") == "container" and attrs.get("fila.root", "").startswith(str(root)):
            lines.append(f"{e['timeNano'] / 1e9 - t0:7.3f}  container {e['Action'].split(':')[0]:9} {name}")
        elif e.get("Type") == "network" and name.startswith("fila-net-"):
            lines.append(f"{e['timeNano'] / 1e9 - t0:7.3f}  network   {e['Action']:9} {name}")
    return lines


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def oneshot_engine(ctx: Ctx, engines: list[str] | None = None, *, events: bool = False) -> list[Row]:
    import docker
    from tests.upstreams.fixtures import start_upstreams

    from bench.engine_startup import built_engines

    client = docker.from_env(timeout=300)
    rows: list[Row] = []
    tmp = ctx.mkdtemp("oneshot-engine")
    try:
        with start_upstreams(client, tmp / "upstreams") as ups:
            for name in built_engines(client, engines or ["claude"]):
                rows += _engine_rows(ctx, name, ups, client, tmp, events)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _engine_rows(ctx: Ctx, name: str, ups: Any, client: Any, tmp: Path, events: bool) -> list[Row]:
    from bench.engine_startup import EngineStartup

    reps = ctx.reps_or(7, 2)
    case = EngineStartup(name, ups, client, tmp, worker=False)
    env = _env({case.key_var: case.secret})
    records: dict[str, list[dict[str, Any]]] = {"fila": [], "before": []}

    def bare_side() -> float:
        case.bare_cli()
        return case.bare_totals[-1]

    def fila_side(cmd: list[str], extra: dict[str, str], into: list[dict[str, Any]]) -> Callable[[], float]:
        def side() -> float:
            case.reset()
            return _one_shot(cmd, case.submit_argv(), env | extra, into)

        return side

    sides = {"fila": fila_side(fila_cmd(), {}, records["fila"]), "bare": bare_side}
    before = _before_cmd()
    if before is not None:
        sides["before"] = fila_side(*before, records["before"])
    ctx.log(f"oneshot: {name}: {reps} rounds of {', '.join(sides)} (load {_load()})")
    image = _image_id()
    got = rounds(sides, reps)
    xs, ys = got["fila"], got["bare"]
    row = _paired(
        f"one-shot: {name} by `fila submit --run` (allowlist, gateway) vs the bare CLI",
        xs,
        ys,
        f"fila's records, medians: {_gateway_parts(records['fila'], reps)}; "
        f"load {_load()}{_same_image(image)}",
        target=f"<= {ENGINE_TARGET}",
        samples=got,
    )
    row.ok = row.ratio is not None and row.ratio <= ENGINE_TARGET
    if events:
        row.extra["timeline"] = timeline(sides["fila"], records["fila"], case.root)
    rows = [row]
    if before is not None:
        rows.append(
            _paired(
                f"one-shot: {name}, BEFORE tree vs the bare CLI",
                got["before"],
                ys,
                f"its records, medians: {_gateway_parts(records['before'], reps)}",
            )
        )
    return rows


def oneshot_egress(ctx: Ctx, *, events: bool = False) -> list[Row]:
    from bench.egress_startup import KEY_VAR, _docker_images, _write_policies
    from bench.filaside import init_root

    client = _docker_images()
    reps = ctx.reps_or(7, 2)
    net = f"fila-bench-oneshot-{uuid.uuid4().hex[:8]}"
    client.networks.create(net, driver="bridge", internal=True, labels={"fila.bench": "oneshot"})
    root = init_root(ctx.mkdtemp("oneshot-root"))
    (root / "a.txt").write_text("a\n")
    _write_policies(root, net, [])
    env = _env({KEY_VAR: "sk-bench-" + uuid.uuid4().hex})
    records: dict[str, list[dict[str, Any]]] = {"allow": [], "none": [], "before": []}

    def argv(policy: str) -> list[str]:
        return ["submit", "--root", str(root), "--engine", "shell", "--command", "true",
                "--target", "a.txt", "--policy", policy, "--json"]  # fmt: skip

    sides: dict[str, Callable[[], float]] = {
        "allow": lambda: _one_shot(fila_cmd(), argv("allow"), env, records["allow"]),
        "none": lambda: _one_shot(fila_cmd(), argv("none"), env, records["none"]),
    }
    before = _before_cmd()
    if before is not None:
        cmd, extra = before
        sides["before"] = lambda: _one_shot(cmd, argv("allow"), env | extra, records["before"])
    try:
        ctx.log(f"oneshot: no-op task, {reps} rounds of {', '.join(sides)} (load {_load()})")
        image = _image_id()
        got = rounds(sides, reps)
        shown = timeline(sides["allow"], records["allow"], root) if events else []
        del records["allow"][reps + 1 :]  # the timeline's round is not a measured one
    finally:
        with contextlib.suppress(Exception):
            client.api.remove_network(net)
    xs, ys = got["allow"], got["none"]
    added = median([x - y for x, y in zip(xs, ys, strict=True)])
    rows = [
        _paired(
            "one-shot: no-op `submit --run`, network allowlist vs none",
            xs,
            ys,
            f"added (median of pairs) {added:.3f} s; allowlist records: "
            f"{_gateway_parts(records['allow'], reps)}; load {_load()}{_same_image(image)}",
            target=f"+{EGRESS_TARGET_S} s",
            ok=added <= EGRESS_TARGET_S,
            samples=got,
        )
    ]
    rows[0].extra["timeline"] = shown
    if before is not None:
        bs = got["before"]
        rows.append(
            _paired(
                "one-shot: no-op allowlist, BEFORE tree vs none",
                bs,
                ys,
                f"added {median([b - y for b, y in zip(bs, ys, strict=True)]):.3f} s; its records: "
                f"{_gateway_parts(records['before'], reps)}",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="measured rounds (default 7)")
    ap.add_argument("--engines", default="claude", help="comma-separated engines (default claude)")
    ap.add_argument("--only", choices=["engine", "egress"], help="one case (default both)")
    ap.add_argument("--timeline", action="store_true", help="one more round with docker events, printed")
    args = ap.parse_args(argv)
    top = Path(tempfile.mkdtemp(prefix="fila-bench-"))
    rows: list[Row] = []
    try:
        ctx = Ctx(tmp=top, reps=args.reps)
        if args.only != "engine":
            rows += oneshot_egress(ctx, events=args.timeline)
        if args.only != "egress":
            engines = [e.strip() for e in args.engines.split(",") if e.strip()]
            rows += oneshot_engine(ctx, engines, events=args.timeline)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    for row in rows:
        print(f"{row.case}: fila {row.fila:.3f} s, base {row.base:.3f} s, ratio {row.ratio:.2f}; {row.note}")
        for side, vs in row.samples.items():
            print(f"  {side}: {' '.join(f'{v:.3f}' for v in vs)}")
        for line in row.extra.get("timeline", []):
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
