"""The Podman backend: rootless Podman through its API socket, no root daemon, no docker group.

Podman speaks the Docker API, so most calls are DockerBackend's (the Docker SDK against the user's
Podman socket). What differs is here:
- The container is created through Podman's own endpoint (`/libpod/containers/create`): the
  Docker-compatible one ignores ulimits in rootless mode (podman#25881, fixed in 5.5; Debian 12 has
  4.3) and cannot ask for `userns=keep-id`, which rootless Podman needs so that the engine runs with
  the user's own uid and can write work/. `libpod_spec` maps create_kwargs' request to it: a pure
  function that refuses any key it does not know, so a new hardening flag cannot be dropped here
  in silence.
- What the host can enforce is measured (`podman info`): rootless containers on cgroup v1 get no
  memory, cpu or pids limits ("Resource limits are not supported and ignored on cgroups V1 rootless
  systems"), so a policy is refused before any container starts unless it `waive`s them.
- `network: allowlist`: the job network and the gateway are made with Podman's own API
  (`egress`: an internal network with DNS off, the gateway on it and on the egress network).
- The socket and the service are this user's alone (`service`).

The modules beside it: `service` (socket, runtime directory, service, client), `spec` (the libpod
request), `overlay` (the overlay strategy on this host) and `egress` (the job network and gateway).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.containers import Container

from ...core.errors import EngineUnavailable, InfraError, InvalidInput, InvalidPolicy
from ...core.models import Policy
from ...core.mounts import overlay_of
from ...core.untrusted import read_capped
from ...egress.config import Gateway
from ...engines.base import JOB_MOUNT
from ..base import JOB_LABEL, ROOT_LABEL, WAIVABLE, Box, RunResult, RunSpec, note_left
from ..docker import images as docker_images
from ..docker.backend import DockerBackend
from ..docker.container import run
from ..docker.spec import VOLUME_LABEL
from ..gateways import GatewayPool
from . import service
from .overlay import job_scratch, overlay_why
from .service import ERRORS, PodmanClient, check_runtime, not_own, podman_exe, socket_from_env, start_service
from .spec import libpod_spec


class PodmanBackend(DockerBackend):
    name = "podman"
    allowlist = True  # the job network and gateway: the `egress` module

    def __init__(
        self,
        socket: Path | None = None,
        *,
        autostart: bool = True,
        say: Callable[[str], None] | None = None,
        timeout: float = 60,
    ) -> None:
        super().__init__(None, timeout=timeout)
        self.socket = socket or socket_from_env() or service.default_socket()
        self.autostart = autostart
        self.say = say or (lambda m: print(f"fila: {m}", file=sys.stderr, flush=True))
        self._start_lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._overlay_why: list[str | None] | None = None

    # -- connections ----------------------------------------------------------------------------

    def _client(self, timeout: float) -> docker.DockerClient:
        c = PodmanClient(base_url=f"unix://{self.socket}", version="1.41", timeout=timeout)
        try:
            c.ping()
        except BaseException:
            c.close()
            raise
        return c

    def connect(self, timeout: float | None = None) -> docker.DockerClient:
        t = self._timeout if timeout is None else timeout
        check_runtime(self.socket)  # before anything is sent: the socket may be another user's
        try:
            return self._client(t)
        except ERRORS as first:
            if not self.autostart:
                raise self._down(first) from first
            with self._start_lock:
                try:
                    return self._client(t)
                except ERRORS:
                    pass
                start_service(self.socket, self.say, lambda: self._client(5).close())
                try:
                    return self._client(t)
                except ERRORS as e:
                    raise self._down(e) from e

    @contextlib.contextmanager
    def client(self) -> Iterator[docker.DockerClient]:
        """Docker's pooled client; an error's hint about the engine's health names Podman's own
        check and the socket fila used, not Docker's."""
        try:
            with super().client() as c:
                yield c
        except InfraError as e:
            if e.hint in docker_images.HEALTH_HINTS:
                e.hint = self.health_hint(retry=e.hint == docker_images.RUN_HINT)
            raise

    def health_hint(self, *, retry: bool = False) -> str:
        """What a person checks when Podman failed a call (as this user: rootless Podman is per user)."""
        hint = f"check `podman info` as this user (fila used the Podman API socket {self.socket})"
        return hint + ("; the task can be retried once Podman is healthy" if retry else "")

    def _down(self, err: BaseException) -> EngineUnavailable:
        return EngineUnavailable(
            f"the Podman API socket {self.socket} does not answer: {err}",
            hint="start it (`podman system service --time=0 &` or `systemctl --user start podman.socket`), "
            "or let fila start it (it does unless the socket was given); FILA_BACKEND=docker uses Docker",
        )

    def ping(self) -> None:
        self.connect(timeout=15).close()

    # -- what the host enforces -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        if self._info is None:
            with self.client() as c:
                try:
                    self._info = dict(c.api._result(c.api._get(c.api._url("/libpod/info")), json=True))
                except ERRORS as e:
                    raise InfraError(f"podman failed while describing its host: {e}") from e
        return self._info

    @property
    def rootless(self) -> bool:
        return bool(self.info().get("host", {}).get("security", {}).get("rootless"))

    def unenforceable(self, policy: Policy) -> list[str]:
        return self._unenforced()

    def _unenforced(self) -> list[str]:
        """What this host's Podman ignores, whatever the policy: each job that runs waived it."""
        host = self.info().get("host", {})
        if not self.rootless:
            return []
        have = set(host.get("cgroupControllers") or [])
        need = {"memory": "memory", "pids": "pids", "cpus": "cpu"}
        return [w for w in WAIVABLE if need[w] not in have]

    def why_unenforceable(self) -> str:
        host = self.info().get("host", {})
        return (
            f"rootless Podman on cgroup {host.get('cgroupVersion', '?')} with controllers "
            f"{host.get('cgroupControllers') or 'none'} delegated: Podman ignores these limits there"
        )

    def check(self, policy: Policy, *, job_id: str | None = None) -> list[str]:
        if policy.network == "allowlist" and not self.allowlist:
            raise InvalidPolicy(
                "the podman backend does not run network allowlist (its job network and gateway are "
                "Docker's); the job was not started",
                hint="use network none (or bridge) with Podman, or FILA_BACKEND=docker for allowlist",
                task_id=job_id,
            )
        if policy.runtime and policy.runtime not in self.runtimes():
            raise InvalidPolicy(
                f"the policy's runtime {policy.runtime!r} is not one Podman has "
                f"({', '.join(self.runtimes())})",
                hint="install it and name it in containers.conf [engine.runtimes], or change the policy",
                task_id=job_id,
            )
        return super().check(policy, job_id=job_id)

    def runtime_for(self, policy: Policy) -> str | None:
        return policy.runtime

    def overlay_unsupported(self) -> str | None:
        """Measured once, from `podman info` and the kernel (overlay_why)."""
        if self._overlay_why is None:
            try:
                filesystems = Path("/proc/filesystems").read_text()
            except OSError:
                filesystems = ""
            try:
                info = self.info()
            except (InfraError, EngineUnavailable) as e:
                self._overlay_why = [f"podman did not say whether it can mount overlay volumes: {e}"]
            else:
                self._overlay_why = [overlay_why(info, os.uname().release, filesystems)]
        return self._overlay_why[0]

    @contextlib.contextmanager
    def _scratch_cleared(self, spec: RunSpec, rootless: bool) -> Iterator[None]:
        """After the run (the container and its mount gone), whatever way it ended; when the run
        failed, its error stays the one raised, and a scratch left behind is noted on it."""
        ov = overlay_of(spec.workspace, JOB_MOUNT)
        if ov is None or not rootless:
            yield
            return
        try:
            yield
        except BaseException as exc:
            try:
                self._clear_scratch(ov.scratch)
            except Exception as e:  # carried on the error (not only a note): the record says it
                note_left(exc, str(e), running=False)
            raise
        self._clear_scratch(ov.scratch)

    def clear_job_scratch(self, root: str, job_id: str) -> bool:
        """Empty a job's overlay scratch by its meta directory, not through a found container: a
        worker killed after its container's removal and before `_scratch_cleared` leaves it with
        no container, and the next attempt's job directory could not be made (the cycle calls
        this under the job's claim and lock, before it rebuilds the job directory)."""
        if not self.rootless:
            return False
        scratch = job_scratch({ROOT_LABEL: root, JOB_LABEL: job_id})
        if scratch is None:
            return False
        self._clear_scratch(scratch)
        return True

    def _pause_pid(self) -> int | None:
        """The pid of rootless Podman's pause process, which holds the user's namespace (Podman
        keeps it beside the API socket's directory: <run dir>/libpod/tmp/pause.pid); None when
        there is none of this user's."""
        run_dir = self.socket.parent.parent
        try:
            # Every directory on the way, and the file, this user's alone (check_runtime's rule):
            # the pid is the namespace whose root then runs `rm -rf`.
            for d in (run_dir, run_dir / "libpod", run_dir / "libpod" / "tmp"):
                if not_own(os.lstat(d), kind="dir"):
                    return None
            path = run_dir / "libpod" / "tmp" / "pause.pid"
            raw = read_capped(path, cap=64, kind="pause.pid", error=InvalidInput)  # no link followed
            if not_own(os.lstat(path), kind="file"):
                return None
            pid = int(raw.decode().strip())
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                return None
        except (OSError, ValueError, InvalidInput):
            return None
        return pid

    def _clear_scratch(self, scratch: Path) -> None:
        """Remove what the kernel left in the overlay's scratch directory (`workdir`): rootless,
        the mount is made by the container's root, a subordinate uid, so `work/` there is that
        uid's, mode 000, and holds the whiteout the upper layer's deletions are hard links of:
        the user could not remove it, nor gc or a requeue the job. rm runs as root of the user's
        own namespace (the user and their subordinate ids, as `podman unshare`), nothing more."""
        leftovers = [str(scratch / n) for n in ("work", "index") if (scratch / n).exists()]
        if not leftovers:
            return
        rm = ["rm", "-rf", "--one-file-system", "--", *leftovers]
        res = None
        pause = self._pause_pid()
        if pause is not None and shutil.which("nsenter"):
            # The same namespace `podman unshare` enters, joined directly: 2 ms, not Podman's 70.
            res = subprocess.run(["nsenter", "-U", "-t", str(pause), "--", *rm],
                                 capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        if res is None or res.returncode != 0 or any(Path(p).exists() for p in leftovers):
            res = subprocess.run([podman_exe(), "unshare", *rm], capture_output=True, text=True, timeout=60,
                                 check=False)  # fmt: skip
        if res.returncode != 0 or any(Path(p).exists() for p in leftovers):
            raise InfraError(
                f"the overlay's scratch directory could not be emptied: {res.stderr.strip()[-300:]}",
                path=scratch,
                hint=f"`podman unshare rm -rf {scratch}/work` as this user removes it",
            )

    def runtimes(self) -> list[str]:
        host = self.info().get("host", {})
        names = set((self.info().get("plugins") or {}).get("runtimes") or [])
        oci = (host.get("ociRuntime") or {}).get("name")
        return sorted(names | ({oci} if oci else set()))

    # -- the run --------------------------------------------------------------------------------

    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        waived = self.check(spec.policy, job_id=spec.job_id)
        rootless = self.rootless
        waive = frozenset(waived)

        def create(client: docker.DockerClient, kwargs: dict[str, Any]) -> Container:
            body = libpod_spec(kwargs, rootless=rootless, waive=waive)
            api = client.api
            try:
                res = api._result(api._post_json(api._url("/libpod/containers/create"), data=body), json=True)
            except NotFound as e:  # Podman: "<image>: image not known"
                raise ImageNotFound(str(e)) from e
            return client.containers.get(res["Id"])

        with self._scratch_cleared(spec, rootless), self.client() as c:
            if spec.policy.network == "allowlist":
                from . import egress as podman_egress

                result = podman_egress.run(
                    spec,
                    client=c,
                    create=create,
                    rootless=rootless,
                    waive=waive,
                    before_start=before_start,
                    heartbeat=heartbeat,
                    heartbeat_s=heartbeat_s,
                    spares=self.gateways,
                )
            else:
                result = run(
                    spec,
                    client=c,
                    before_start=before_start,
                    heartbeat=heartbeat,
                    heartbeat_s=heartbeat_s,
                    create=create,
                )
        result.backend, result.waived = self.name, waived
        return result

    def remove(self, box: Box) -> bool:
        """Also the overlay scratch directory of the job's container (a crashed worker left it,
        and recovery removes the container): in the job's meta directory, named by its labels and
        checked against fila's job layout (job_scratch)."""
        gone = super().remove(box)
        if box.labels.get(VOLUME_LABEL) and self.rootless:
            try:
                scratch = job_scratch(box.labels)
            except ValueError as e:
                self.say(f"the overlay scratch of container {box.name} was not removed: {e}")
                return gone
            if scratch is not None:
                self._clear_scratch(scratch)
        return gone

    def tags(self, image: str) -> list[str]:
        # Podman names local images with their registry (docker.io/fila/shell:latest, localhost/x).
        return sorted(
            {re.sub(r"^(?:docker\.io/(?:library/)?|localhost/)", "", t) for t in super().tags(image)}
        )

    def spare_gateways(self, directory: Path, labels: dict[str, str], *, refill: bool) -> GatewayPool | None:
        return super().spare_gateways(directory, labels, refill=refill) if self.allowlist else None

    def handoff_gateways(self, gateways: list[Gateway], directory: Path) -> bool:
        return False  # Podman's gateways are removed with its own pod-less steps (podman/egress.py)

    def spare_maker(self) -> Callable[..., Gateway]:
        """Podman's gateway, with the limits this host cannot enforce waived as every job that
        runs here has waived them (PodmanBackend.check)."""
        from . import egress as podman_egress

        return functools.partial(
            podman_egress.create, rootless=self.rootless, waive=frozenset(self._unenforced())
        )

    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        from . import egress as podman_egress

        with self.client() as c:
            try:
                return podman_egress.sweep(c, root, meta_dir, has_claim)
            except ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping job networks: {e}") from e

    def refusal(self, err: BaseException) -> str | None:
        cause = err.__cause__
        if isinstance(cause, APIError) and cause.status_code == 400:
            return str(cause.explanation or cause)
        return None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        info = self.info()
        host = info.get("host", {})
        return {
            **d,
            "name": self.name,
            "socket": str(self.socket),
            "rootless": self.rootless,
            "cgroup": host.get("cgroupVersion"),
            "controllers": host.get("cgroupControllers") or [],
            "storage": (info.get("store") or {}).get("graphDriverName"),
        }

    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> AbstractContextManager[tuple[str, str]]:
        raise InfraError(
            "the doctor's allowlist self-test has no Podman upstream yet (the allowlist itself runs on "
            "Podman: tests/test_podman_egress.py proves it); run `fila doctor` with FILA_BACKEND=docker"
        )


__all__ = ["PodmanBackend", "check_runtime", "job_scratch", "libpod_spec", "overlay_why"]
