"""What `network: allowlist` adds to a job: the job network and the gateway, started and removed.

The same no-op job (the shell engine running `true`) through fila's sandbox (`sandbox.run`: create,
start, wait, remove, reclaim), under `network: none` and under `network: allowlist`, alternating
A B A B so both see the same machine. The allowlist side also creates the job's internal network,
writes the gateway's config and secret, starts `fila/gateway` and waits for it to be ready, then
removes all of it and reads its log: everything a job with a gateway pays over one without. Its
egress network is an `--internal` network of the bench's own (nothing is sent anywhere).

    .venv/bin/python -m bench.egress_startup [--reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import Ctx, Row, alternate, median, paired_ratio
from fila.sandbox.docker.backend import DockerBackend
from fila.workspace.strategy import CopyWorkspace

KEY_VAR = "FILA_BENCH_EGRESS_KEY"


def _spec(tmp: Path, policy: object, tag: str) -> object:
    from fila.sandbox.docker.backend import RunSpec

    job_id = f"bench-{tag}-{uuid.uuid4().hex[:8]}"
    job_dir = tmp / job_id
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()
    (job_dir / "TASK.md").write_text("no-op\n")
    return RunSpec(
        job_id=job_id,
        workspace=CopyWorkspace(job_dir),
        image="fila/shell:latest",
        argv=["/bin/sh", "-c", "true"],
        env={"PATH": "/usr/bin:/bin"},
        policy=policy,  # type: ignore[arg-type]
        limits=None,
        timeout_ms=60_000,
        log_path=tmp / f"{job_id}.log",
        labels={"fila.bench": "egress_startup"},
        egress_dir=tmp / f"{job_id}.egress",
    )


def egress_startup(ctx: Ctx) -> list[Row]:
    from fila.core.models import Policy
    from fila.sandbox.docker import backend as sandbox
    from fila.sandbox.docker import egress
    from fila.sandbox.images import ensure_image, find_image

    client = sandbox.docker_client()
    ensure_image("shell", DockerBackend(client), progress=lambda _m: None)
    if find_image(DockerBackend(client), egress.GATEWAY_IMAGE) is None:
        raise SystemExit(f"{egress.GATEWAY_IMAGE} is not built: `fila images build gateway`")
    reps = ctx.reps_or(15, 3)
    net = f"fila-bench-egress-{uuid.uuid4().hex[:8]}"
    client.networks.create(net, driver="bridge", internal=True, labels={"fila.bench": "egress_startup"})
    os.environ[KEY_VAR] = "sk-bench-" + uuid.uuid4().hex
    base = dict(max_timeout_ms=60_000, default_timeout_ms=60_000, memory="256m")
    none = Policy.model_validate(base | {"network": "none"})
    allow = Policy.model_validate(
        base
        | {
            "network": "allowlist",
            "egress": {
                "allow": [{"host": "registry.npmjs.org"}],
                "routes": {"anthropic": {"credential": KEY_VAR}},
                "egress_network": net,
            },
        }
    )
    egress.validate(allow)
    tmp = ctx.mkdtemp("egress-startup")

    def job(policy: Policy, tag: str) -> float:
        spec = _spec(tmp, policy, tag)
        t = time.perf_counter()
        res = sandbox.run(spec, client=client)  # type: ignore[arg-type]
        took = time.perf_counter() - t
        if res.exit_code != 0:
            raise RuntimeError(f"the no-op job under {tag} exited {res.exit_code}")
        return took

    starts: list[float] = []
    stops: list[float] = []

    def phases() -> None:
        """The gateway alone, no engine: network + config + container until ready, then removal."""
        uid, gid = sandbox.run_as()
        t = time.perf_counter()
        tag = uuid.uuid4().hex[:8]
        gw = egress.start(
            client, job_id=f"bench-phase-{tag}", policy=allow, state=tmp / f"phase-{tag}",
            labels={"fila.bench": "egress_startup"}, uid=uid, gid=gid,
        )  # fmt: skip
        starts.append(time.perf_counter() - t)
        t = time.perf_counter()
        egress.stop(client, gw)
        stops.append(time.perf_counter() - t)

    try:
        ctx.log(f"egress_startup: {reps} no-op jobs a side (allowlist vs none), alternating")
        xs, ys = alternate(lambda: job(allow, "allowlist"), lambda: job(none, "none"), reps)
        for _ in range(max(3, reps // 3)):
            phases()
    finally:
        with contextlib.suppress(Exception):
            client.api.remove_network(net)
        shutil.rmtree(tmp, ignore_errors=True)
    added = [x - y for x, y in zip(xs, ys, strict=True)]
    return [
        Row(
            "egress: no-op job, allowlist vs none",
            median(xs),
            median(ys),
            "s",
            ratio=paired_ratio(xs, ys),
            note=f"added per job (median of pairs): {median(added):.3f} s; of it, gateway start until "
            f"ready {median(starts):.3f} s, removal of gateway + network {median(stops):.3f} s",
            samples={"allowlist": xs, "none": ys},
        )
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    top = Path(tempfile.mkdtemp(prefix="fila-bench-"))
    try:
        (row,) = egress_startup(Ctx(tmp=top, quick=args.quick, reps=args.reps))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print(f"{row.case}: allowlist {row.fila:.3f} s, none {row.base:.3f} s, ratio {row.ratio:.2f}; {row.note}")
    print(f"  allowlist samples: {' '.join(f'{v:.3f}' for v in row.samples['allowlist'])}")
    print(f"  none samples:      {' '.join(f'{v:.3f}' for v in row.samples['none'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
