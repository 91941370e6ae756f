"""The seam between fila and a container engine (docs/architecture.md, "Layers").

The cycle, the worker, recovery and the doctor call a backend by the role they need (`Runner`,
`ImageStore`, `HostProbe`; `Backend` is all three); only the modules of this package talk to an
engine's API. A backend maps the policy to its engine's request in one pure function
(`create_kwargs` for the Docker API), mounts the job's files as the RunSpec's Workspace says
(docs/architecture.md, "The Workspace seam"), enforces the host's wall-clock timeout, always
removes what it created, and labels it so a later sweep finds what a killed fila left behind.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.models import EgressRecord, ImageRef, Limits, Policy
from ..core.mounts import ProvidedVolume, Workspace
from ..core.output import RunOutput

if TYPE_CHECKING:
    from ..egress.config import Gateway
    from .gateways import GatewayPool

LABEL = "fila"
JOB_LABEL = "fila.job"
ROOT_LABEL = "fila.root"
WORKER_LABEL = "fila.worker"

# The engine never runs as root: when fila itself does, the container gets this uid ("nobody"),
# and work/ is handed to it for the run and back afterwards (Workspace.hand_over and reclaim).
UNPRIVILEGED = 65534


def run_as() -> tuple[int, int]:
    """The uid:gid the engine runs as inside the container."""
    uid, gid = os.getuid(), os.getgid()
    return (UNPRIVILEGED, UNPRIVILEGED) if uid == 0 else (uid, gid)


def container_name(job_id: str) -> str:
    return f"fila-{job_id[:100]}-{secrets.token_hex(4)}"


@dataclass
class RunSpec:
    job_id: str
    # input/ and work/: what the container mounts, and the hooks that hand work/ over and back
    workspace: Workspace
    image: str
    argv: list[str]
    env: dict[str, str]
    policy: Policy
    limits: Limits | None
    timeout_ms: int
    log_path: Path
    labels: dict[str, str]
    redact: list[str] = field(default_factory=list)
    # network allowlist: the gateway's config, secrets and log (0700; never under job_dir)
    egress_dir: Path | None = None
    # the caller awaits RunResult.removal before it publishes anything (see Backend.run)
    defer_removal: bool = False
    # an environment's provided paths, mounted read-only over work/ (docs/environments.md)
    volumes: list[ProvidedVolume] = field(default_factory=list)
    # an environment's setup: root inside, a writable root, its result committed as an image
    setup: SetupRun | None = None

    @property
    def job_dir(self) -> Path:
        return self.workspace.job_dir


# What a package manager needs as root in a setup container (chown, files of other users, its
# privilege drop); every other capability stays dropped, and no-new-privileges holds.
SETUP_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL")


@dataclass(frozen=True)
class SetupRun:
    """A project environment's setup run (docs/environments.md, "The setup"): it runs as root in
    its container, with a writable root file system and SETUP_CAPS only, and once it exits 0 the
    container is committed as `commit_tag` with `changes` (Dockerfile instructions: labels, and
    the gateway's proxy variables emptied) before it is removed."""

    commit_tag: str
    changes: tuple[str, ...] = ()
    max_bytes: int = 16 << 30  # what its container may write (checked on every heartbeat)


class Removal:
    """A container's removal running in the background once the container has exited
    (`RunSpec.defer_removal`): the host reads work/ meanwhile, since the diff needs
    the container stopped, not gone. `wait()` returns once the container (and its work volume) is
    gone, and raises the error a removal inside `run` raises (an InfraError) when it failed. A
    process that dies first leaves the container to recovery, which finds it by its labels, as
    after a crash inside `run`."""

    def __init__(self, name: str, remove: Callable[[], None]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the removal took, wherever it was awaited
        self.timings: dict[str, float] = {}  # its parts the record shows (gateway_remove)
        self.warnings: list[str] = []  # what it left for recovery without failing (a gateway)
        self._done = threading.Event()
        threading.Thread(target=self._remove, args=(remove,), name=f"fila-remove-{name}", daemon=True).start()

    def _remove(self, remove: Callable[[], None]) -> None:
        t = time.monotonic()
        try:
            remove()
        except BaseException as e:  # raised by wait(), in the thread that awaits it
            self.error = e
        finally:
            self.seconds = round(time.monotonic() - t, 3)
            self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


@dataclass
class RunResult:
    exit_code: int | None
    timed_out: bool
    oom_killed: bool
    started_at: str
    ended_at: str
    duration_s: float
    container_id: str
    container_name: str
    image_id: str
    log_bytes: int
    log_truncated: bool
    warnings: list[str] = field(default_factory=list)  # what reclaiming the job dir found
    limit_exceeded: str | None = None  # the container was killed for breaking a disk limit
    egress: EgressRecord | None = None  # what the job's gateway logged (network allowlist)
    backend: str = ""  # the backend that ran it (named in the record)
    waived: list[str] = field(default_factory=list)  # limits the policy let this backend leave unenforced
    # stdout apart from stderr, for classification (the log file has both, interleaved)
    output: RunOutput = field(default_factory=RunOutput)
    # defer_removal: the container's removal, still running; awaited before anything is published
    removal: Removal | None = None
    # The job's gateway: gateway_start (made for the job) or gateway_take (a spare), gateway_ready
    # (until it listens, before the engine), gateway_serve (after the engine's start, until it serves),
    # gateway_depart (its kill's wait for the daemon's departure lock: sandbox/docker/removal.py;
    # gateway_depart_unlocked when it went without);
    # gateway_remove is the removal's (Removal.timings, or here when removed inside `run`).
    gateway_timings: dict[str, float] = field(default_factory=dict)
    # A setup run's result: the id of the image its container was committed as (RunSpec.setup).
    committed: str | None = None
    # Why the caller ended the run early (a heartbeat raised StopRun): the container was stopped as
    # at its timeout, and what it produced is kept. None: it exited by itself, or timed out.
    stopped: str | None = None


class StopRun(Exception):
    """Raised by a run's heartbeat to end the run now and keep its result: the backend stops the
    container as at its timeout (SIGTERM, SIGKILL after `grace_ms`, the policy's grace when None)
    and returns the RunResult with `stopped` set to `reason`. Any other exception from the
    heartbeat aborts the run."""

    def __init__(self, reason: str, *, grace_ms: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.grace_ms = grace_ms


def call_heartbeat(heartbeat: Callable[[], None] | None, grace_s: float) -> tuple[str | None, float]:
    """One turn of a run's heartbeat, for every backend's wait loop: the reason to stop the run
    (None: carry on) and the grace its stop gets (a StopRun's own `grace_ms` shortens it)."""
    if heartbeat is None:
        return None, grace_s
    try:
        heartbeat()
    except StopRun as e:
        return e.reason, grace_s if e.grace_ms is None else min(grace_s, e.grace_ms / 1000)
    return None, grace_s


@dataclass(frozen=True)
class Box:
    """One of fila's containers as a sweep sees it (any state)."""

    id: str
    name: str
    status: str  # created, running, exited, ...
    labels: dict[str, str]
    exit_code: int | None = None

    def describe(self) -> str:
        desc = f"{self.name} {self.status}"
        if self.status == "exited":
            desc += f" (exit code {self.exit_code})"
        if self.status == "created":
            desc += " (never started)"
        return desc


@dataclass(frozen=True)
class ImageInfo:
    """A local image as sandbox/images.py needs it: its id, labels (build inputs) and tags."""

    id: str
    labels: dict[str, str]
    tags: list[str]
    env: list[str] = field(default_factory=list)  # its config's variables, NAME=value
    size: int = 0
    onbuild: list[str] = field(default_factory=list)  # its ONBUILD triggers: run by a build FROM it


# The limits a policy sets that a backend may be unable to enforce on a host; `waive` names them.
WAIVABLE = ("memory", "pids", "cpus")


class Connection(ABC):
    """What every caller of a container engine needs: its name, whether it answers, and the
    release of its connections. Thread-safe: one instance serves every job slot of a worker.
    Errors are fila's own (core/errors.py): EngineUnavailable when the engine does not answer,
    InfraError for what it failed to do, ImageMissing for an absent image."""

    name: str = ""

    @abstractmethod
    def ping(self) -> None:
        """Raise EngineUnavailable (the engine does not answer) with what to do next."""

    def close(self) -> None:  # noqa: B027 (a backend without connections has nothing to release)
        """Release connections (idempotent)."""


class Runner(Connection):
    """What the cycle, the worker and recovery need: run one job's container (its policy checked
    first) and sweep what a killed fila left behind."""

    allowlist: bool = True  # runs `network: allowlist` (a job network and a gateway)

    @abstractmethod
    def unenforceable(self, policy: Policy) -> list[str]:
        """The limits of WAIVABLE this backend cannot enforce on this host (measured, cached)."""

    def check(self, policy: Policy, *, job_id: str | None = None) -> list[str]:
        """Before any container starts: refuse a policy whose limits this backend cannot enforce
        here unless the policy waives each of them. Returns the waived limits (for the record)."""
        from ..core.errors import InvalidPolicy

        missing = self.unenforceable(policy)
        waive = getattr(policy, "waive", None) or []
        waived = [w for w in missing if w in waive]
        refused = [w for w in missing if w not in waive]
        if refused:
            raise InvalidPolicy(
                f"the {self.name} backend cannot enforce the policy's {', '.join(refused)} limit"
                f"{'s' if len(refused) > 1 else ''} on this host ({self.why_unenforceable()}); "
                "the job was not started",
                hint=f'add "waive": {sorted(set(refused) | set(waived))} to the policy to run without '
                "them (shown in the review), or use a backend or host that enforces them "
                "(FILA_BACKEND=docker, or cgroup v2 with delegation for rootless Podman)",
                task_id=job_id,
            )
        return waived

    def why_unenforceable(self) -> str:
        return "not supported"

    def overlay_unsupported(self) -> str | None:
        """Why this backend cannot give a job's work/ as an overlay of a snapshot on this host
        (the job then copies its targets, and the record says why); None when it can."""
        return f"the {self.name} backend does not mount overlay volumes"

    def clear_job_scratch(self, root: str, job_id: str) -> bool:
        """Empty a job's overlay scratch (sandbox/meta/<id>/overlay/work) when only this backend can
        (rootless Podman: the kernel leaves it to a subordinate uid); True when something was
        emptied. The caller holds the job's lock and knows no live claim uses it. Others: False."""
        return False

    @abstractmethod
    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        """Create, start, wait (with the host's timeout), and always remove the job's container.

        `before_start(container_id)` runs between create and start: the side-effect boundary the
        caller records durably, and its last chance to refuse (raise; the container is then
        removed unstarted). `heartbeat()` runs every `heartbeat_s` while the container runs.
        `spec.defer_removal`: a backend that can returns once the container has exited and work/
        is handed back, its removal running on in `RunResult.removal`, which the caller must
        await before it publishes anything; one that cannot removes it first (removal None).
        A heartbeat that raises StopRun ends the run as its timeout would, and the result is
        returned with `stopped` set (it is not `timed_out`)."""

    @abstractmethod
    def find(self, *, job_id: str | None = None, root: str | None = None) -> list[Box]:
        """fila's containers in any state, by label (of one job, one queue root, or all)."""

    @abstractmethod
    def remove(self, box: Box) -> bool:
        """Force-remove one container by id; False when it was gone already."""

    @abstractmethod
    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        """Remove job networks, gateways and gateway directories of jobs no live worker holds."""

    # Spare gateways (sandbox/gateways.py) this backend keeps for a worker, once it was asked to.
    gateways: GatewayPool | None = None

    def spare_gateways(self, directory: Path, labels: dict[str, str], *, refill: bool) -> GatewayPool | None:
        """The pool of spare gateways kept in `directory` (made on the first call), or None where
        this backend starts no gateway. The worker that asked closes it (`GatewayPool.close`)."""
        return None

    def handoff_gateways(self, gateways: list[Gateway], directory: Path) -> bool:
        """Give `gateways` (done with, or never taken) to a process of their own that removes
        them after this one exits (a one-shot's teardown off its path: GatewayPool.close); False
        where this backend has none (the caller removes them)."""
        return False

    def sweep_spares(self, root: Path, directory: Path) -> list[str]:
        """Remove the spare gateways of `directory` whose maker is gone (taken by a job or not):
        their containers and networks (by label, `root`'s), directories and locks; what was
        removed, described."""
        from .gateways import abandoned, clear_temp, forget

        gone = sorted(abandoned(directory, set()))
        for spare in gone:
            forget(directory, spare)
        return [f"spare gateway directory {directory / s}" for s in gone] + clear_temp(directory)

    def sweep_volumes(self, root: str) -> list[tuple[str, str | None]]:
        """Remove fila's volumes of this queue root that no container uses (a process killed
        between a container's removal and its work volume's leaves one): (name, job id) each."""
        return []

    def refusal(self, err: BaseException) -> str | None:
        """The engine's own words when it refused a request as malformed (the task's fault, not
        an outage), else None."""
        return None


class ImageStore(Connection):
    """What sandbox/images.py needs: the engine's local images and the primitives that build,
    import, pull, tag and smoke-test them (images.py decides what to build and when)."""

    def image(self, tag: str) -> ImageRef | None:
        """The image by tag, or None when it is not there (from `image_info`)."""
        info = self.image_info(tag)
        return ImageRef(tag=tag, id=info.id) if info is not None else None

    def tags(self, image: str) -> list[str]:
        """The local tags of an image (by id or name); [] when it is not there."""
        info = self.image_info(image)
        return list(info.tags) if info is not None else []

    @abstractmethod
    def image_info(self, tag: str) -> ImageInfo | None:
        """The image by tag or id with its labels and tags; None when it is not there."""

    @abstractmethod
    def build(
        self,
        engine: str,
        *,
        base: str | None = None,
        ca_file: Path | None = None,
        force: bool = False,
        progress: Callable[[str], None] = print,
        verbose: bool = False,
    ) -> ImageRef:
        """Build `fila/<engine>:latest` on this engine (sandbox/images.py decides what and when);
        `progress` gets a line per Dockerfile step, and the engine's raw stream when `verbose`."""

    @abstractmethod
    def build_context(
        self,
        context: Path,
        tag: str,
        *,
        buildargs: dict[str, str],
        labels: dict[str, str],
        nocache: bool,
        progress: Callable[[str], None],
        network: str | None = None,
        dockerfile: str | None = None,
        target: str | None = None,
    ) -> None:
        """Build a Dockerfile context as `tag` (no pull); ImageMissing when the build fails.
        `network`: the build's network (default: the backend's), `dockerfile` relative to the
        context, `target` the stage to stop at."""

    @abstractmethod
    def import_image(self, archive: Path, tag: str, changes: list[str]) -> None:
        """A root filesystem tarball as image `tag` (Dockerfile `changes` applied)."""

    @abstractmethod
    def pull(self, image: str) -> str | None:
        """Pull from a registry: None when done, else why not."""

    @abstractmethod
    def tag_image(self, image_id: str, tag: str) -> None: ...

    @abstractmethod
    def remove_image(self, ref: str) -> None:
        """Best effort (an image a container still uses stays)."""

    @abstractmethod
    def smoke_run(self, image: str, argv: tuple[str, ...]) -> tuple[int | None, str]:
        """argv in the image, hardened and without network: (exit code or None on timeout, output)."""


class HostProbe(Connection):
    """What the doctor asks of the host: the runtimes, the engine's version, and a test upstream
    for the allowlist's self-test."""

    @abstractmethod
    def runtimes(self) -> list[str]:
        """The OCI runtimes the engine offers (runc, crun, runsc...)."""

    def runtime_for(self, policy: Policy) -> str | None:
        """The engine's name of the policy's runtime (None: the engine's default)."""
        return policy.runtime

    @abstractmethod
    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> AbstractContextManager[tuple[str, str]]:
        """A server (`argv` in `image`) on a new internal network, reachable by `aliases` there:
        yields (network name, subnet) and removes both afterwards (the doctor's allowlist test)."""

    def describe(self) -> dict[str, Any]:
        """What the doctor shows: name, version, where it listens."""
        return {"name": self.name}


class Backend(Runner, ImageStore, HostProbe):
    """A container engine fila runs jobs on: one class per engine implements every role, and
    each caller types what it holds by the role it uses (docs/architecture.md, "Layers")."""


LEFT_ATTR = "fila_left"  # on an exception a failed run raises: what it could not remove


def note_left(exc: BaseException, what: str, *, running: bool = True) -> None:
    """Say on the error a failed run raises what it could not clean up (`left_behind` reads it):
    the caller must not publish the job as over while its container may still run. A note
    too, for a traceback; never the only carrier (nothing reads notes)."""
    left = getattr(exc, LEFT_ATTR, None)
    if left is None:
        left = []
        setattr(exc, LEFT_ATTR, left)
    left.append((what, running))
    exc.add_note(f"fila: {what}")


def left_behind(exc: BaseException) -> list[tuple[str, bool]]:
    """(what, may still run) for each thing a failed run could not clean up (note_left)."""
    return list(getattr(exc, LEFT_ATTR, None) or [])
