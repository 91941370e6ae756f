"""The task's optional `check` (docs/architecture.md, "The cycle"): after the engine succeeded, a
second container of the shell image with network none runs the check command on a copy of the
job's work/, so what the check writes (caches, build output) never reaches the diff or what
`fila apply` verifies. Its result goes into the record; `fila compare` shows it per member.

The job runner (run/attempts.py) calls `run_check` with its state of the claimed task, which this
module knows only by the `Job` protocol: the runner imports this module, not the other way round.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core import fsutil
from ..core.errors import InfraError
from ..core.layout import check_id
from ..core.models import CheckResult, ImageRef
from ..core.mounts import ProvidedVolume
from ..queue import store as queue

if TYPE_CHECKING:
    from ..core.layout import Root
    from ..core.models import Policy, Record, Task
    from ..queue.policy import Effective
    from ..sandbox.base import Runner

# Where versions before the `~` separator (core/layout.py, LOG_SEP) wrote the check's log: read
# for their records only.
OLD_CHECK_LOG_SUFFIX = ".check.log"
HEARTBEAT_S = 1.0  # how often the sandbox calls back while the check runs: the lease, a stop


class Gate(Protocol):
    def before_start(self, container: str) -> None:
        """Last chance to stop before the container starts (a draining worker stops here, a runner
        of the PostgreSQL queue marks the task started)."""


class Job(Protocol):
    """What the check needs of the claimed job it runs in: where it is, whose claim it runs
    under, the sandbox the engine ran in, and the calls that keep the claim and the record honest
    while a container runs (the job runner's state of one task has each)."""

    root: Root
    tid: str
    claim: queue.Claim
    hooks: Gate
    progress: Callable[[str], None]

    @property
    def backend(self) -> Runner:
        """The job's backend; the check only runs a container on it (read-only here, so the job
        may hold the whole Backend)."""
        ...

    def checkpoint(self, **fields: Any) -> None: ...

    def fence(self) -> None: ...

    def heartbeat(self) -> None: ...


def run_check(
    job: Job,
    task: Task,
    policy: Policy,
    effective: Effective,
    job_dir: Path,
    refs: dict[str, ImageRef],
    *,
    redact: list[str] | None = None,
    image: str | None = None,
    volumes: list[ProvidedVolume] | None = None,
) -> CheckResult:
    """Run the task's `check` on a copy of work/ with the sandbox the engine ran in, network none,
    the task's limits and timeout. `redact`: the run's credentials, kept out of the check's log as
    out of the engine's (work/ may hold one). `image` and `volumes`: the task's project environment
    (docs/environments.md), whose `sh` runs the check instead of the shell engine's image."""
    from ..engines import get_engine
    from ..sandbox import RunSpec
    from ..workspace.strategy import CopyWorkspace

    root, tid = job.root, job.tid
    assert task.check is not None
    shell = get_engine("shell")
    image = image or shell.image_tag()
    # Host-only per-job data: the task id's own directory, so no task id can name this copy.
    copy = root.meta(tid) / "check"
    fsutil.remove_tree(copy)
    (copy / "input").mkdir(parents=True)
    # The real tool: cp -a copies links as links and a fifo as a fifo (never reading it).
    res = subprocess.run(
        ["cp", "-a", "--", str(job_dir / "work"), str(copy / "work")], capture_output=True, text=True
    )
    if res.returncode != 0:
        raise InfraError(f"could not copy work/ for the check: {res.stderr.strip()[:500]}", task_id=tid)
    inv = shell.invocation(task.model_copy(update={"command": task.check}))
    if volumes is not None or image is not None:  # an environment: its image's PATH is the project's
        inv.env.pop("PATH", None)
    log = root.check_log_path(tid)
    spec = RunSpec(
        job_id=tid,
        workspace=CopyWorkspace(copy),
        image=image,
        argv=inv.argv,
        env=inv.env,
        policy=policy.model_copy(update={"network": "none", "egress": None}),
        limits=effective.limits,
        timeout_ms=effective.timeout_ms,
        log_path=log,
        labels={"fila.root": str(root.path), "fila.worker": job.claim.worker},
        redact=list(redact or []),
        volumes=list(volumes or []),
    )

    def before_start(container_id: str) -> None:
        job.hooks.before_start(container_id)
        job.checkpoint(container=container_id, event="check started")
        job.fence()

    job.progress(f"{tid}: running the check: {task.check}")
    try:
        result = job.backend.run(
            spec, before_start=before_start, heartbeat=job.heartbeat, heartbeat_s=HEARTBEAT_S
        )
    finally:
        fsutil.remove_tree(copy)
    passed = result.exit_code == 0 and not result.timed_out and not result.oom_killed
    queue.log_event(root, tid, "check exited", exit_code=result.exit_code, passed=passed)
    return CheckResult(
        command=task.check,
        passed=passed,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        duration_s=result.duration_s,
        log_path=str(log.relative_to(root.path)),
        image=ImageRef(tag=image, id=result.image_id or refs[image].id),
    )


def check_log(root: Root, rec: Record) -> Path:
    """Where the task's check wrote its log: the name the check writes for this id, or for a
    record of a version before the `~` separator the old name, when its record names that; never
    any other path a record names."""
    old = root.logs_dir / f"{check_id(rec.id)}{OLD_CHECK_LOG_SUFFIX}"
    if rec.check is not None and rec.check.log_path == str(old.relative_to(root.path)):
        return old
    return root.check_log_path(rec.id)
