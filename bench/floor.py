"""The floor: what a careful shell loop does for one task without fila.

`cp -a` of the project twice (input/ and work/), `docker run --rm` with exactly the container
fila's sandbox creates (the flags are translated from `sandbox.create_kwargs`, so a hardening
option added there either appears here or stops the benchmark), and `git diff --no-index --binary`.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import run

IMAGE = "fila/shell:latest"


def _mount(m: dict[str, Any]) -> str:
    known = {"Target", "Source", "Type", "ReadOnly"}
    extra = {k for k, v in m.items() if v and k not in known}
    if extra:
        raise ValueError(f"bench: mount options {sorted(extra)} are not translated; update bench/floor.py")
    opts = [f"type={m['Type']}", f"source={m['Source']}", f"target={m['Target']}"]
    if m.get("ReadOnly"):
        opts.append("readonly")
    return ",".join(opts)


def docker_run_args(kwargs: dict[str, Any]) -> list[str]:
    """`docker run --rm ...` for the docker SDK's `containers.create(**kwargs)`.

    Every key is translated or refused: a benchmark floor with weaker isolation than fila's
    would flatter nobody but the floor.
    """
    kw = dict(kwargs)
    argv = ["docker", "run", "--rm"]
    image = kw.pop("image")
    entrypoint = kw.pop("entrypoint")
    command = kw.pop("command")
    for key, value in kw.items():
        if key == "name":
            argv += ["--name", value]
        elif key == "environment":
            for k, v in value.items():
                argv += ["-e", f"{k}={v}"]
        elif key == "working_dir":
            argv += ["-w", value]
        elif key == "user":
            argv += ["-u", value]
        elif key == "hostname":
            argv += ["-h", value]
        elif key == "labels":
            for k, v in value.items():
                argv += ["--label", f"{k}={v}"]
        elif key == "mounts":
            for m in value:
                argv += ["--mount", _mount(m)]
        elif key == "network_mode":
            argv += ["--network", value]
        elif key == "mem_limit":
            argv += ["--memory", f"{value}b"]
        elif key == "memswap_limit":
            argv += ["--memory-swap", f"{value}b"]
        elif key == "nano_cpus":
            argv += ["--cpus", f"{value / 1e9:g}"]
        elif key == "pids_limit":
            argv += ["--pids-limit", str(value)]
        elif key == "ulimits":
            for u in value:
                argv += ["--ulimit", f"{u['Name']}={u['Soft']}:{u['Hard']}"]
        elif key == "read_only":
            argv += ["--read-only"] if value else []
        elif key == "tmpfs":
            for path, opts in value.items():
                argv += ["--tmpfs", f"{path}:{opts}"]
        elif key == "cap_drop":
            for cap in value:
                argv += ["--cap-drop", cap]
        elif key == "cap_add":
            for cap in value or []:
                argv += ["--cap-add", cap]
        elif key == "security_opt":
            for opt in value:
                argv += ["--security-opt", opt]
        elif key == "privileged":
            argv += ["--privileged"] if value else []
        elif key == "init":
            argv += ["--init"] if value else []
        elif key == "ipc_mode":
            argv += ["--ipc", value]
        elif key == "oom_score_adj":
            argv += ["--oom-score-adj", str(value)]
        elif key == "stop_signal":
            argv += ["--stop-signal", value]
        elif key == "log_config":
            argv += ["--log-driver", value["Type"]]
            for k, v in (value.get("Config") or {}).items():
                argv += ["--log-opt", f"{k}={v}"]
        elif key == "stdin_open":
            argv += ["-i"] if value else []
        elif key == "tty":
            argv += ["-t"] if value else []
        elif key == "runtime":
            argv += ["--runtime", value]
        else:
            raise ValueError(f"bench: create_kwargs key {key!r} is not translated; update bench/floor.py")
    return [*argv, "--entrypoint", entrypoint[0], image, *command]


@dataclass
class FloorSpec:
    """What fila's sandbox would run for a no-op shell task, minus the job directory."""

    root: Path  # a `fila init`-ed root, for the policy and the fila.root label
    command: str = "true"
    image: str = IMAGE

    def docker_args(self, job_dir: Path, name: str) -> list[str]:
        from fila.core.layout import Root
        from fila.core.models import Task
        from fila.engines import get_engine
        from fila.queue.policy import load_policy, narrow
        from fila.sandbox.docker.backend import RunSpec, create_kwargs
        from fila.workspace.strategy import CopyWorkspace

        root = Root.at(self.root)
        task = Task(engine="shell", command=self.command, targets=["."])
        policy, _ = load_policy(root, "default")
        eff = narrow(policy, task, name="default")
        engine = get_engine("shell")
        inv = engine.invocation(task)
        creds, _secrets = engine.credentials()
        spec = RunSpec(
            job_id=job_dir.name,
            workspace=CopyWorkspace(job_dir),
            image=self.image,
            argv=inv.argv,
            env={**inv.env, **creds},
            policy=policy,
            limits=eff.limits,
            timeout_ms=eff.timeout_ms,
            log_path=job_dir.parent / f"{job_dir.name}.log",
            labels={"fila.root": str(root.path), "fila.worker": "bench-floor"},
        )
        return docker_run_args(create_kwargs(spec, name))


def new_job(jobs: Path, i: int) -> Path:
    job = jobs / f"job{i:04d}"
    (job / "input").mkdir(parents=True)
    (job / "work").mkdir()
    return job


def copy_in(project: Path, job: Path) -> None:
    run(["cp", "-a", f"{project}/.", str(job / "input")])
    run(["cp", "-a", f"{project}/.", str(job / "work")])


def docker_run(args: list[str], log: Path) -> None:
    with open(log, "wb") as f:
        run(args, stdout=f, stderr=subprocess.STDOUT)


def git_diff(job: Path) -> None:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
    with open(job / "DIFF.patch", "wb") as f:
        run(["git", "diff", "--no-index", "--binary", "input", "work"], cwd=job, stdout=f, env=env, ok=(0, 1))


def floor_task(project: Path, job: Path, args: list[str]) -> dict[str, float]:
    """One task the floor's way; seconds per step."""
    t0 = time.perf_counter()
    copy_in(project, job)
    t1 = time.perf_counter()
    docker_run(args, job.parent / f"{job.name}.log")
    t2 = time.perf_counter()
    git_diff(job)
    t3 = time.perf_counter()
    return {"copy": t1 - t0, "run": t2 - t1, "diff": t3 - t2, "total": t3 - t0}
