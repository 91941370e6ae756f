"""How long each engine CLI takes inside fila, against the bare CLI in the same image: a whole
task, and the engine's start to its first model request.

For each engine image that is built (fila/<engine>:latest), alternating A B A B:

  A  a real fila job: `fila submit` to a long-running `fila worker` (which keeps a spare gateway
     started between tasks), the engine's adapter and a `network: allowlist` policy whose model
     route goes through the egress gateway to the scripted model server of tests/upstreams (the
     policy shape of tests/test_engines.py);
  B  the bare CLI in the same image, `docker run` on the upstream network with the argv and
     environment the adapter produces (`engine.invocation_for(task, policy)`), its base URL pointed
     straight at the model server over plain HTTP and the key in its own variable: no gateway, no
     fila (the floor).

Two measures. The whole task: fila's claim to record (the record's `timings`: total + record)
against `docker run` to its exit and `docker rm` (target: 1.2x at most). The start: from the
container's start (the daemon's `start` event, which carries the State.StartedAt instant; fila
removes its container before it could be inspected) to the model server logging the CLI's first
model request (its `t`, milliseconds). Both clocks are this machine's. The script answers with the
tests' edit and a final text, so every run completes. The model server and its network are the
tests' own (`--internal`, sealed: nothing leaves).

    .venv/bin/python -m bench.engine_startup [--reps N] [--engines claude,codex]
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import Ctx, Row, alternate, fila_cmd, median, paired_ratio

ENGINES = ("claude", "codex", "opencode", "gemini", "qwen", "aider")
PROMPT = "Create hello.txt saying hello."
LABEL = "fila.bench"
RUN_TIMEOUT_S = 300


def _t(iso: str) -> float:
    """Seconds since the epoch of an ISO-8601 UTC time (the model server's `t`)."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(UTC).timestamp()


def _start_events(client: Any, since: float, until: float) -> list[dict[str, Any]]:
    """The daemon's container `start` events between two instants (historical: the call returns)."""
    evs = client.events(
        since=int(since) - 1,
        until=int(until) + 1,
        filters={"type": "container", "event": "start"},
        decode=True,
    )
    return [e for e in evs if e.get("status") == "start" or e.get("Action") == "start"]


def _first_model_request(ups: Any, protocol: str) -> float:
    """When the model server logged the first request of the engine's protocol."""
    for r in ups.requests("model.test"):
        if r.get("protocol") == protocol:
            return _t(r["t"])
    raise RuntimeError(
        f"the CLI sent no {protocol} request to the model server: {ups.requests('model.test')}"
    )


class EngineStartup:
    """One engine's two sides, sharing the upstreams, a fila root and a bare job directory."""

    def __init__(self, engine: str, ups: Any, client: Any, tmp: Path, *, worker: bool = True) -> None:
        from tests.support.engines import E2E_ENGINES, KEY_VAR, engine_policy, model_script
        from tests.support.project import make_root

        from fila.core.models import Policy, Task
        from fila.engines import get_engine

        self.engine, self.ups, self.client = engine, ups, client
        self.spec = E2E_ENGINES[engine]
        self.script = model_script(self.spec)
        self.key_var = KEY_VAR
        self.secret = f"sk-bench-{uuid.uuid4().hex}"
        self.root = tmp / f"{engine}-root"
        self.root.mkdir()
        make_root(self.root)
        (self.root / "a.txt").write_text("hello\n")
        engine_policy(self.root, ups, engine, self.spec.route)
        policy = Policy.model_validate_json((self.root / "policies" / f"{engine}.json").read_text())
        task = Task(engine=engine, prompt=PROMPT, model=self.spec.model, targets=["a.txt"])
        self.eng = get_engine(engine)
        self.inv = self.eng.invocation_for(task, policy)
        self.policy = policy
        self.bare = tmp / f"{engine}-bare"
        self.fila_totals: list[float] = []  # claim to record, from each record's timings
        self.bare_totals: list[float] = []  # `docker run` to its exit and removal
        # One long-running worker for the engine's root, as a CI fleet or a team runs one: it keeps
        # a spare gateway started between tasks (sandbox/gateways.py). Without it (`worker=False`,
        # bench/oneshot.py) each task is a fresh `fila submit --run`.
        self.worker = None
        if worker:
            self.worker = subprocess.Popen(
                [*fila_cmd(), "worker", "--root", str(self.root), "--quiet"],
                env={**os.environ, self.key_var: self.secret},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def submit_argv(self) -> list[str]:
        """`fila submit` of the engine's task (add `--run` for the one-shot form)."""
        return [
            *("submit", "--json", "--root", str(self.root), "--engine", self.engine),
            *("--model", self.spec.model, "--target", "a.txt", "--policy", self.engine),
            *("--prompt", PROMPT),
        ]

    def reset(self) -> None:
        """The model server's script set again and its request log emptied, before a run."""
        self.ups.set_script(self.script)
        self.ups.clear_requests()

    def close(self) -> None:
        if self.worker is None:
            return
        self.worker.terminate()
        try:
            self.worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.worker.kill()

    def fila_job(self) -> float:
        """A: a task submitted to the engine's worker, waited for until its record is there; the
        job container's start to the first model request."""
        self.reset()
        t0 = time.time()
        p = subprocess.run(
            [*fila_cmd(), *self.submit_argv()],
            env={**os.environ, self.key_var: self.secret},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=True,
        )
        rec = _record(self.root / "fila" / "out" / f"{json.loads(p.stdout)['id']}.json")
        t1 = time.time()
        if rec.get("status") != "needs_review":
            raise RuntimeError(f"fila {self.engine} job did not end in needs_review: {rec.get('error')}")
        self.fila_totals.append(rec["timings"]["total"] + rec["timings"].get("record", 0.0))
        from fila.egress.config import ROLE_LABEL
        from fila.sandbox.docker.backend import JOB_LABEL

        starts = [
            e["timeNano"] / 1e9
            for e in _start_events(self.client, t0, t1)
            if (a := e.get("Actor", {}).get("Attributes", {})).get("fila.root", "").startswith(str(self.root))
            and JOB_LABEL in a
            and ROLE_LABEL not in a
        ]
        if len(starts) != 1:
            raise RuntimeError(f"expected one job container start for {self.engine}, saw {len(starts)}")
        return _first_model_request(self.ups, self.spec.protocol) - starts[0]

    def bare_cli(self) -> float:
        """B: `docker run` of the image with the adapter's argv and env, straight at the model server."""
        from fila.egress.config import KNOWN_ROUTES
        from fila.engines.base import HOME, JOB_MOUNT
        from fila.sandbox.base import run_as

        self.reset()
        shutil.rmtree(self.bare, ignore_errors=True)
        (self.bare / "work").mkdir(parents=True)
        (self.bare / "work" / "a.txt").write_text("hello\n")
        (self.bare / "TASK.md").write_text(PROMPT + "\n")
        known = KNOWN_ROUTES[self.spec.route]
        env = self.inv.env | {
            known.base_url_env: "http://model.test" + known.base_url_suffix,
            known.key_env: self.secret,
        }
        uid, gid = run_as()
        name = f"fila-bench-engine-startup-{uuid.uuid4().hex[:8]}"
        tmpfs = self.policy.tmpfs
        # `-e NAME` takes the value from this process's environment: values may hold newlines.
        argv = ["docker", "run", "--name", name, "--label", f"{LABEL}=engine_startup"]
        argv += ["--network", self.ups.network, "--user", f"{uid}:{gid}", "--workdir", JOB_MOUNT]
        argv += ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--init"]
        argv += ["--tmpfs", f"/tmp:rw,nosuid,nodev,exec,size={tmpfs.tmp},mode=1777"]
        argv += ["--tmpfs", f"{HOME}:rw,nosuid,nodev,exec,size={tmpfs.home},uid={uid},gid={gid},mode=0700"]
        argv += ["-v", f"{self.bare}:{JOB_MOUNT}:ro", "-v", f"{self.bare / 'work'}:{JOB_MOUNT}/work:rw"]
        argv += [a for k in env for a in ("-e", k)]
        argv += ["--entrypoint", self.inv.argv[0], self.eng.image_tag(), *self.inv.argv[1:]]
        ran: float | None = None
        try:
            t0 = time.perf_counter()
            p = subprocess.run(
                argv,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
            ran = time.perf_counter() - t0  # `docker inspect` below is the bench's, not the task's
            started = json.loads(
                subprocess.run(
                    ["docker", "inspect", "--format", "{{json .State.StartedAt}}", name],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
        finally:
            t1 = time.perf_counter()
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
            if ran is not None:
                self.bare_totals.append(ran + time.perf_counter() - t1)
        if p.returncode != 0:
            raise RuntimeError(
                f"bare {self.engine} exited {p.returncode}: {p.stdout[-800:]} {p.stderr[-800:]}"
            )
        # Docker gives nanoseconds; Python's ISO parser takes microseconds.
        head, _, frac = started.rstrip("Z").partition(".")
        start = _t(f"{head}.{frac[:6].ljust(6, '0')}+00:00")
        return _first_model_request(self.ups, self.spec.protocol) - start


def _record(path: Path) -> dict[str, Any]:
    """The task's record once it is no longer queued or running."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            rec = dict(json.loads(path.read_text()))
            if rec.get("status") not in ("queued", "running"):
                return rec
        time.sleep(0.05)
    raise RuntimeError(f"no record at {path} within {RUN_TIMEOUT_S} s")


def built_engines(client: Any, wanted: list[str]) -> list[str]:
    from docker.errors import ImageNotFound

    out = []
    for e in wanted:
        try:
            client.images.get(f"fila/{e}:latest")
            out.append(e)
        except ImageNotFound:
            print(f"engine_startup: fila/{e}:latest is not built, skipped", file=sys.stderr)
    return out


def engine_startup(ctx: Ctx, engines: list[str] | None = None) -> list[Row]:
    import docker
    from tests.upstreams.fixtures import start_upstreams

    client = docker.from_env(timeout=300)
    reps = ctx.reps_or(3, 2)
    names = built_engines(client, list(engines or ENGINES))
    rows: list[Row] = []
    tmp = ctx.mkdtemp("engine-startup")
    try:
        with start_upstreams(client, tmp / "upstreams") as ups:
            for name in names:
                case = EngineStartup(name, ups, client, tmp)
                ctx.log(f"engine_startup: {name}: {reps} runs a side (fila job vs bare CLI), alternating")
                try:
                    xs, ys = alternate(case.fila_job, case.bare_cli, reps)
                finally:
                    case.close()
                ft, bt = case.fila_totals[-reps:], case.bare_totals[-reps:]  # the warm-up pair left out
                rows.append(
                    Row(
                        f"a whole task: {name} through fila (claim to record) vs bare `docker run`",
                        median(ft),
                        median(bt),
                        "s",
                        ratio=paired_ratio(ft, bt),
                        note=f"added by fila (median of pairs) "
                        f"{median([x - y for x, y in zip(ft, bt, strict=True)]):.3f} s; target 1.2x",
                        samples={"fila": ft, "bare": bt},
                    )
                )
                rows.append(
                    Row(
                        f"engine start to first model request: {name}",
                        median(xs),
                        median(ys),
                        "s",
                        ratio=paired_ratio(xs, ys),
                        note=f"added by fila (median of pairs) "
                        f"{median([x - y for x, y in zip(xs, ys, strict=True)]):.3f} s",
                        samples={"fila": xs, "bare": ys},
                    )
                )
    finally:
        with contextlib.suppress(Exception):
            for c in client.containers.list(all=True, filters={"label": f"{LABEL}=engine_startup"}):
                c.remove(force=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="measured runs a side per engine (default 3)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default: all six)")
    args = ap.parse_args(argv)
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(wanted) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    top = Path(tempfile.mkdtemp(prefix="fila-bench-"))
    try:
        rows = engine_startup(Ctx(tmp=top, reps=args.reps), wanted)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    for row in rows:
        print(f"{row.case}: fila {row.fila:.3f} s, bare {row.base:.3f} s, ratio {row.ratio:.2f}; {row.note}")
        print(f"  fila samples: {' '.join(f'{v:.3f}' for v in row.samples['fila'])}")
        print(f"  bare samples: {' '.join(f'{v:.3f}' for v in row.samples['bare'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
