"""What `network: allowlist` adds to a task, claim to record, beside the same task under
`network: none`, through one long-running `fila worker` (which keeps a spare gateway started).

The same no-op task (the shell engine running `true` on a one-file project), submitted under a
`none` policy and under an `allowlist` policy (one route, whose upstream is never called; the
egress network is an `--internal` network of the bench's own: nothing is sent anywhere), A B A B,
each waited for until its record is there, then `--gap` seconds of quiet (a real engine's task
takes minutes: the worker makes the next spare meanwhile; GAP_S). Each side's figure is the record's own
`timings` (`total` + `record`: claim to record). The allowlist records' gateway timings
(`gateway_take`, `gateway_ready`, `gateway_remove`) are reported beside, and, for reference, a
gateway made for a job with no spare (`egress.start` until ready, then `egress.stop`).

`--backend podman` measures the same on rootless Podman: as root, the bench makes a throwaway
ordinary user (bench/rootless.py), loads Docker's fila/gateway and fila/shell into its Podman
storage (`docker save | podman load`), and as that user makes the internal egress network, runs
the worker and submits the tasks; both policies waive the limits rootless Podman on cgroup v1
cannot enforce (`rootless.WAIVED`), as every job there must.

    .venv/bin/python -m bench.egress_startup [--backend docker|podman] [--reps N] [--gap S]
        [--storage DRIVER (podman: the user's storage driver, e.g. overlay; default the host's)]
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

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio
from bench.filaside import ensure_image, init_root
from bench.floor import IMAGE
from bench.rootless import WAIVED, podman_user
from fila.egress.config import GATEWAY_IMAGE

KEY_VAR = "FILA_BENCH_EGRESS_KEY"
WAIT_S = 120.0

# What the issue asks of the added seconds (median of pairs), per backend.
TARGET_S = {"docker": 0.3, "podman": 1.0}
# The quiet after each task, per backend: long enough for the worker to make the next spare and
# remove the last, as it does while a real engine runs. Rootless Podman on vfs storage (this
# host's default) takes about 10 s to make one (docs/benchmarks.md, "egress").
GAP_S = {"docker": 3.0, "podman": 15.0}


def _policy_docs(net: str, waive: list[str]) -> dict[str, dict[str, Any]]:
    base: dict[str, Any] = {"max_timeout_ms": 60_000, "default_timeout_ms": 60_000, "memory": "256m"}
    if waive:
        base["waive"] = waive
    allow = base | {
        "network": "allowlist",
        "egress": {"routes": {"anthropic": {"credential": KEY_VAR}}, "egress_network": net},
    }
    return {"none": base | {"network": "none"}, "allow": allow}


def _write_policies(root: Path, net: str, waive: list[str]) -> None:
    for name, doc in _policy_docs(net, waive).items():
        (root / "policies" / f"{name}.json").write_text(json.dumps(doc))


def _submit(fila: list[str], root: Path, policy: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [*fila, "submit", "--root", str(root), "--engine", "shell", "--command", "true",
         "--target", "a.txt", "--policy", policy, "--json"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    return str(json.loads(out)["id"])


def _record(root: Path, tid: str) -> dict[str, Any]:
    path = root / "fila" / "out" / f"{tid}.json"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            rec = json.loads(path.read_text())
            if rec.get("status") not in ("queued", "running"):
                if rec["status"] != "needs_review":
                    raise RuntimeError(f"task {tid}: {rec['status']}: {rec.get('error')}")
                return dict(rec)
        time.sleep(0.02)
    raise RuntimeError(f"task {tid}: no record within {WAIT_S:g} s")


def _side_by_side(
    fila: list[str], root: Path, env: dict[str, str], reps: int, gap: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """One `fila worker` on `root`; `reps` allowlist and none tasks alternating (after a discarded
    pair); each side's claim to record, and the allowlist records' gateway timings."""
    worker = subprocess.Popen(
        [*fila, "worker", "--root", str(root), "--quiet"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    parts: dict[str, list[float]] = {}
    warnings: list[str] = []
    seen: dict[str, int] = {}

    def task(policy: str) -> float:
        rec = _record(root, _submit(fila, root, policy, env))
        warnings.extend(f"{rec['id']}: {w}" for w in rec.get("warnings") or [])
        t = rec["timings"]
        seen[policy] = seen.get(policy, 0) + 1
        if policy == "allow" and seen[policy] > 1:  # the first pair is alternate's warm-up
            for k, v in t.items():
                if k.startswith("gateway_"):
                    parts.setdefault(k, []).append(v)
        time.sleep(gap)
        return float(t["total"] + t.get("record", 0.0))

    try:
        log(f"egress_startup: {reps} no-op tasks a side (allowlist vs none), alternating, {gap:g} s apart")
        xs, ys = alternate(lambda: task("allow"), lambda: task("none"), reps)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
    return {"allowlist": xs, "none": ys, "parts": parts, "warnings": warnings, "left": _left(root)}


def _left(root: Path) -> list[str]:
    """What of the root's is still there once its worker has stopped (it removes its spares, and
    its jobs' gateways and networks are gone): containers and networks labelled with the root."""
    exe = "podman" if os.environ.get("FILA_BACKEND") == "podman" else "docker"
    flt = ["--filter", f"label=fila.root={root}"]
    boxes = subprocess.run([exe, "ps", "-a", "--format", "{{.Names}}", *flt], capture_output=True, text=True)
    nets = subprocess.run(
        [exe, "network", "ls", "--format", "{{.Name}}", *flt], capture_output=True, text=True
    )
    return (boxes.stdout + nets.stdout).split()


def _cold(
    start: Callable[[str, Path], Any], stop: Callable[[Any], None], tmp: Path, n: int
) -> dict[str, Any]:
    """A gateway made for a job with no spare to take: created, configured, started until ready
    (what a job without a pool pays before its container), then removed."""
    starts, stops = [], []
    for i in range(n):
        t = time.perf_counter()
        gw = start(f"bench-cold-{i}-{uuid.uuid4().hex[:6]}", tmp / str(i))
        starts.append(time.perf_counter() - t)
        t = time.perf_counter()
        stop(gw)
        stops.append(time.perf_counter() - t)
    return {"cold_start": starts, "cold_stop": stops}


def _allow_policy(net: str, waive: list[str]) -> Any:
    from fila.core.models import Policy

    return Policy.model_validate(_policy_docs(net, waive)["allow"])


def egress_startup(
    ctx: Ctx, *, gap: float | None = None, backend: str = "docker", storage: str | None = None
) -> list[Row]:
    gap = GAP_S.get(backend, 0.0) if gap is None else gap
    if backend == "podman":
        return egress_startup_podman(ctx, gap=gap, storage=storage)
    if backend != "docker":
        raise ValueError(f"egress_startup: unknown backend {backend!r} (docker or podman)")
    import docker

    from fila.sandbox.base import run_as
    from fila.sandbox.docker import egress

    client = _docker_images()
    reps = ctx.reps_or(9, 3)
    net = f"fila-bench-egress-{uuid.uuid4().hex[:8]}"
    client.networks.create(net, driver="bridge", internal=True, labels={"fila.bench": "egress_startup"})
    env = os.environ | {KEY_VAR: "sk-bench-" + uuid.uuid4().hex}
    root = init_root(ctx.mkdtemp("egress-root"))
    (root / "a.txt").write_text("a\n")
    _write_policies(root, net, [])
    try:
        got = _side_by_side(fila_cmd(), root, env, reps, gap, ctx.log)
        os.environ[KEY_VAR] = env[KEY_VAR]
        policy, (uid, gid) = _allow_policy(net, []), run_as()

        def start(job: str, state: Path) -> Any:
            return egress.start(client, job_id=job, policy=policy, state=state,
                                labels={"fila.bench": "egress_startup"}, uid=uid, gid=gid)  # fmt: skip

        got |= _cold(start, lambda gw: egress.stop(client, gw), ctx.mkdtemp("egress-cold"), max(3, reps // 3))
    finally:
        with contextlib.suppress(docker.errors.DockerException):
            client.api.remove_network(net)
    return [_row("egress: no-op task claim to record, allowlist vs none (one worker)", "docker", got)]


def _docker_images() -> Any:
    """Docker's client, once fila/shell and fila/gateway are there (shell built when missing)."""
    import docker

    ensure_image()
    client = docker.from_env()
    try:
        client.images.get(GATEWAY_IMAGE)
    except docker.errors.ImageNotFound:
        raise SystemExit(f"{GATEWAY_IMAGE} is not built: `fila images build gateway`") from None
    return client


def egress_startup_podman(ctx: Ctx, *, gap: float = GAP_S["podman"], storage: str | None = None) -> list[Row]:
    reps = ctx.reps_or(7, 3)
    _docker_images().close()
    with podman_user(ctx, "bench.egress_startup", storage=storage) as user:
        driver = user.run("podman", "info", "--format", "{{.Store.GraphDriverName}}").stdout.strip()
        ctx.log(f"egress_startup (podman): loading {GATEWAY_IMAGE} and {IMAGE} as {user.name}")
        user.load_images(GATEWAY_IMAGE, IMAGE)
        mine = ctx.mkdtemp("podman")
        os.chown(mine, user.uid, user.uid)
        ctx.log(
            f"egress_startup (podman): {reps} no-op tasks a side as {user.name}, alternating, {gap:g} s apart"
        )
        out = user.py("measure", str(mine), str(reps), str(gap), timeout=1800).stdout
    got = json.loads(out.splitlines()[-1])
    case = "egress: no-op task claim to record, allowlist vs none (one worker), rootless Podman"
    return [_row(f"{case}, {driver} storage", "podman", got)]


def as_user(argv: list[str]) -> None:
    """The user's side of egress_startup_podman (run by `rootless.User.py`, as the ordinary user):
    `measure DIR REPS GAP`: a queue root on Podman under DIR, the bench's internal egress network
    in the user's Podman, the side-by-side run and the gateways made without a spare; prints
    their figures as JSON (the last line)."""
    cmd, *rest = argv
    if cmd != "measure":
        raise SystemExit(f"bench.egress_startup.as_user: unknown command {cmd!r}")
    from fila.sandbox.base import run_as
    from fila.sandbox.docker import egress as docker_egress
    from fila.sandbox.podman import egress as podman_egress
    from fila.sandbox.podman.backend import PodmanBackend

    top, reps, gap = Path(rest[0]), int(rest[1]), float(rest[2])
    fila = [sys.executable, "-c", "from fila.cli import main; main()"]
    root = top / "root"
    subprocess.run(
        [*fila, "init", "--root", str(root), "--backend", "podman"], check=True, capture_output=True
    )
    (root / "a.txt").write_text("a\n")
    net = f"fila-bench-egress-{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "network", "create", "--internal", "--label", "fila.bench=egress_startup", net],
                   check=True, capture_output=True)  # fmt: skip
    _write_policies(root, net, WAIVED)
    env = dict(os.environ) | {KEY_VAR: "sk-bench-" + uuid.uuid4().hex}
    try:
        got = _side_by_side(fila, root, env, reps, gap, lambda m: print(m, file=sys.stderr, flush=True))
        os.environ[KEY_VAR] = env[KEY_VAR]
        policy, (uid, gid) = _allow_policy(net, WAIVED), run_as()
        backend = PodmanBackend()
        waive = frozenset(backend.unenforceable(policy))
        with backend.client() as c:

            def start(job: str, state: Path) -> Any:
                return podman_egress.start(c, job_id=job, policy=policy, state=state,
                                           labels={"fila.bench": "egress_startup"}, uid=uid, gid=gid,
                                           rootless=backend.rootless, waive=waive)  # fmt: skip

            got |= _cold(start, lambda gw: docker_egress.stop(c, gw), top / "cold", max(3, reps // 3))
    finally:
        subprocess.run(["podman", "network", "rm", "-f", net], capture_output=True, check=False)
    print(json.dumps(got))


def _row(case: str, backend: str, got: dict[str, Any]) -> Row:
    xs, ys = got["allowlist"], got["none"]
    added = [x - y for x, y in zip(xs, ys, strict=True)]
    took = ", ".join(f"{k} {median(v):.3f} s" for k, v in sorted(got["parts"].items()))
    limit = TARGET_S[backend]
    return Row(
        case,
        median(xs),
        median(ys),
        "s",
        target=f"added <= {limit:g} s",
        ok=median(added) <= limit,
        ratio=paired_ratio(xs, ys),
        note=f"added per task (median of pairs): {median(added):.3f} s; the allowlist records' {took}; "
        f"a gateway made for a job (no spare): start until ready {median(got['cold_start']):.3f} s, "
        f"removal {median(got['cold_stop']):.3f} s"
        + (
            f"; the records' warnings ({len(got['warnings'])}): {got['warnings'][0]}"
            if got["warnings"]
            else ""
        )
        + f"; left once the worker stopped: {', '.join(got['left']) or 'nothing'}",
        samples={"allowlist": xs, "none": ys, "added": added},
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("docker", "podman"), default="docker")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--gap", type=float, default=None, help="seconds of quiet after each task (default 3, podman 15)"
    )
    ap.add_argument("--storage", help="podman: the user's storage driver (e.g. overlay; default: the host's)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.storage and args.backend != "podman":
        ap.error("--storage is for --backend podman")
    top = Path(tempfile.mkdtemp(prefix="fila-bench-"))
    try:
        ctx = Ctx(tmp=top, quick=args.quick, reps=args.reps)
        (row,) = egress_startup(ctx, gap=args.gap, backend=args.backend, storage=args.storage)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    verdict = "met" if row.ok else "MISSED"
    print(f"{row.case}: allowlist {row.fila:.3f} s, none {row.base:.3f} s, ratio {row.ratio:.2f} "
          f"(target {row.target}: {verdict}); {row.note}")  # fmt: skip
    for k, v in row.samples.items():
        print(f"  {k:9} {' '.join(f'{x:.3f}' for x in v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
