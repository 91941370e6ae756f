"""The Docker backend: one class that implements every role of base.Backend on the Docker SDK
(docs/architecture.md, "Layers"), with pooled connections to the daemon.

The work is in the modules beside it, by role: `spec` (the hardened request, from the policy and
the job's Workspace), `container` (create, start, wait with the host's timeout, always remove),
`logs` (the output to the log and to classification), `sweep` (fila's containers by label),
`client` (connections), `images` (image primitives) and `egress` (the job network and gateway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from ...core.errors import EngineUnavailable, InfraError
from ...core.models import ImageRef, Policy
from ...egress.config import Gateway
from ..base import (
    JOB_LABEL,
    LABEL,
    ROOT_LABEL,
    UNPRIVILEGED,
    Backend,
    Box,
    ImageInfo,
    RunResult,
    RunSpec,
    run_as,
)
from ..gateways import GatewayPool
from . import envstore
from . import images as docker_images
from .client import DOCKER_ERRORS, docker_client
from .container import remove_volume, run
from .removal import departs, remove_container
from .spec import VOLUME_LABEL, create_kwargs, docker_runtime
from .sweep import find_containers, remove_containers

__all__ = [
    "JOB_LABEL",
    "UNPRIVILEGED",
    "DockerBackend",
    "RunResult",
    "RunSpec",
    "create_kwargs",
    "docker_client",
    "find_containers",
    "remove_containers",
    "run",
    "run_as",
]


def _overlay_check(backend: DockerBackend) -> str | None:
    try:
        if "\toverlay\n" not in Path("/proc/filesystems").read_text():
            return "this kernel has no overlay filesystem"
    except OSError:
        return "this host has no /proc/filesystems (not Linux): no overlay filesystem"
    try:
        with backend.client() as c:
            info = c.info()
    except (*DOCKER_ERRORS, EngineUnavailable) as e:
        return f"the {backend.name} daemon did not say whether it can mount overlay volumes: {e}"
    if info.get("OSType") not in (None, "linux"):
        return f"the {backend.name} daemon runs {info.get('OSType')}, not Linux"
    rootless = any("rootless" in str(o) for o in info.get("SecurityOptions") or [])
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if rootless and (release is None or (int(release[1]), int(release[2])) < (5, 11)):
        return (
            f"rootless {backend.name} on kernel {os.uname().release} cannot mount overlay "
            "(it needs 5.11+, or fuse-overlayfs)"
        )
    return None


@dataclasses.dataclass
class BuildLimits:
    """A project Dockerfile's build's limits (build_limits): the cgroup its RUN steps are made
    under (None: none could be made, `refused` says why), and after the build, a step killed for
    writing past the limit (`exceeded`)."""

    cgroup_parent: str | None
    refused: str | None
    exceeded: str | None = None


class DockerBackend(Backend):
    """Docker (the default). Clients are pooled here, one per concurrent job at most: a new client
    and its ping cost ~8 ms a task, and one job's calls never wait for another's. A client that
    saw an error is closed, never reused. `client` (tests, `fila run` with a given client) is used
    for every call and never closed.

    The daemon is asked its API version once (the first client's GET /version); later clients
    reuse it. A ping is skipped while the daemon answered within FRESH_S (a request that worked,
    or a ping): it would only say so again. Any error forgets that, so the next ping asks."""

    name = "docker"
    POOL_MAX = 16
    FRESH_S = 2.0

    def __init__(self, client: docker.DockerClient | None = None, *, timeout: float = 60) -> None:
        self._given = client
        self._timeout = timeout
        self._pool: list[docker.DockerClient] = []
        self._lock = threading.Lock()
        self._overlay_why: list[str | None] | None = None
        self._overlay_lock = threading.Lock()
        self._version: str | None = None
        self._answered_at = -self.FRESH_S - 1.0  # never

    # -- connections ------------------------------------------------------------------------

    def _answered(self, ok: bool = True) -> None:
        self._answered_at = time.monotonic() if ok else -self.FRESH_S - 1.0  # an error: ask again

    def _fresh(self) -> bool:
        return time.monotonic() - self._answered_at < self.FRESH_S

    def connect(self, timeout: float | None = None) -> docker.DockerClient:
        """A new client, checked (EngineUnavailable when the daemon does not answer): the first by
        asking the daemon's API version, a later one by a ping unless the daemon just answered."""
        t = self._timeout if timeout is None else timeout
        try:
            c = docker_client(t, version=self._version, check=not self._fresh())
        except EngineUnavailable:
            self._answered(False)
            raise
        self._version = self._version or c.api.api_version
        self._answered()
        return c

    @contextlib.contextmanager
    def client(self) -> Iterator[docker.DockerClient]:
        """A client for the duration of the block: from the pool, or new."""
        if self._given is not None:
            yield self._given
            return
        with self._lock:
            c = self._pool.pop() if self._pool else None
        if c is None:
            c = self.connect()
        healthy = False
        try:
            yield c
            healthy = True
        finally:
            self._answered(healthy)
            keep = False
            if healthy:
                with self._lock:
                    if len(self._pool) < self.POOL_MAX:
                        self._pool.append(c)
                        keep = True
            if not keep:
                with contextlib.suppress(Exception):
                    c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._pool = self._pool, []
        for c in idle:
            with contextlib.suppress(Exception):
                c.close()

    def ping(self) -> None:
        if self._given is not None:
            try:
                self._given.ping()
            except DOCKER_ERRORS as e:
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
            return
        if self._fresh():
            return  # it answered a moment ago (one ping a process, not one per job and recovery)
        with self._lock:
            c = self._pool.pop() if self._pool else None
        if c is None:
            # A new client is checked (15 s: a hung daemon is reported soon), then pooled with
            # the usual timeout: the job that follows uses this connection.
            c = self.connect(timeout=15)
            c.api.timeout = self._timeout
        else:
            try:
                c.api.get(f"{c.api.base_url}/_ping", timeout=15).raise_for_status()
            except DOCKER_ERRORS as e:
                self._answered(False)
                with contextlib.suppress(Exception):
                    c.close()  # a client that saw an error is never reused
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
            self._answered()
        with self._lock:
            if len(self._pool) < self.POOL_MAX:
                self._pool.append(c)
                return
        c.close()

    # -- the seam -----------------------------------------------------------------------------

    def unenforceable(self, policy: Policy) -> list[str]:
        return []  # the daemon runs as root with cgroups: every limit create_kwargs sets holds

    def overlay_unsupported(self) -> str | None:
        """Measured once: the kernel must have overlayfs, and a rootless daemon (in a user
        namespace) needs a kernel that mounts overlay there (5.11+; else fuse-overlayfs)."""
        if self._overlay_why is None:
            with self._overlay_lock:  # a worker asks early, in the background: one /info a backend
                if self._overlay_why is None:
                    self._overlay_why = [_overlay_check(self)]
        return self._overlay_why[0]

    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        waived = self.check(spec.policy, job_id=spec.job_id)
        with self.client() as c:
            result = run(
                spec,
                client=c,
                before_start=before_start,
                heartbeat=heartbeat,
                heartbeat_s=heartbeat_s,
                defer_removal=spec.defer_removal,
                spares=self.gateways,
            )
        result.backend, result.waived = self.name, waived
        return result

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
        from .. import images

        return images.build(
            engine, self, base=base, ca_file=ca_file, force=force, progress=progress, verbose=verbose
        )

    def ensure_image(self, engine: str, *, progress: Callable[[str], None] = print) -> ImageRef:
        from .. import images

        return images.ensure_image(engine, self, progress=progress)

    # Build networking: none for a build on Podman (rootless networking needs a usable tun);
    # Docker's default for Docker.
    build_network: str | None = None

    def image_info(self, tag: str) -> ImageInfo | None:
        with self.client() as c:
            return docker_images.image_info(c, tag, engine=self.name)

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
        limits: dict[str, int] | None = None,
        deadline_s: float | None = None,
        cgroup_parent: str | None = None,
    ) -> None:
        """`network`: the build's network instead of the backend's (a project's Dockerfile builds on
        its gateway's job network, or none: docs/environments.md); `dockerfile` relative to the
        context, `target` a stage."""
        with self.client() as c:
            docker_images.build_context(
                c,
                context,
                tag,
                buildargs=buildargs,
                labels=labels,
                nocache=nocache,
                progress=progress,
                engine=self.name,
                network_mode=network or self.build_network,
                dockerfile=dockerfile,
                target=target,
                limits=limits,
                deadline_s=deadline_s,
                cgroup_parent=cgroup_parent,
            )

    # A project environment's store (docs/environments.md): Docker only; the other backends
    # have no `fill_volume`, and env/build refuses an environment on them.
    def fill_volume(
        self, image: str, source: str, name: str, labels: dict[str, str], *, max_bytes: int
    ) -> None:
        with self.client() as c:
            envstore.fill_volume(c, image, source, name, labels, max_bytes=max_bytes)

    def build_network_refusal(self) -> str | None:
        """Why a project Dockerfile's RUN steps cannot have a gateway's network here (None: they
        can): the bridge must be closed to the host first (hostseal)."""
        from . import hostseal

        with self.client() as c:
            return hostseal.refusal(c)

    @contextlib.contextmanager
    def build_limits(self, root: Path, job_id: str, pids: int, max_bytes: int) -> Iterator[BuildLimits]:
        """For one project Dockerfile's build: the cgroup its RUN steps are made under, holding
        them to `pids` processes in all (hostseal.pids_parent), and what they write measured
        while they run, a step past `max_bytes` killed (hostseal.SizeWatch); or why it cannot be."""
        from . import hostseal

        refused = hostseal.pids_refusal()
        if refused is not None:
            yield BuildLimits(None, refused)
            return
        with hostseal.pids_parent(hostseal.cgroup_name(root, job_id), pids) as parent, self.client() as c:
            watch = hostseal.SizeWatch(c, parent, max_bytes)
            limits = BuildLimits(parent, None)
            try:
                yield limits
            finally:
                watch.stop()
                limits.exceeded = watch.exceeded

    @contextlib.contextmanager
    def build_gateway(
        self, *, job_id: str, policy: Policy, state: Path, labels: dict[str, str]
    ) -> Iterator[envstore.BuildGateway]:
        """A gateway for one project Dockerfile's build (envstore.build_gateway), on a connection
        of its own for the build's whole length."""
        with (
            self.client() as c,
            envstore.build_gateway(c, job_id=job_id, policy=policy, state=state, labels=labels) as gateway,
        ):
            yield gateway

    def labelled_images(self, label: str) -> list[ImageInfo]:
        with self.client() as c:
            return envstore.labelled_images(c, label)

    def labelled_volumes(self, label: str) -> list[dict[str, Any]]:
        with self.client() as c:
            return envstore.labelled_volumes(c, label)

    def remove_named_volume(self, name: str) -> bool:
        with self.client() as c:
            return envstore.remove_volume(c, name)

    def import_image(self, archive: Path, tag: str, changes: list[str]) -> None:
        with self.client() as c:
            docker_images.import_image(c, archive, tag, changes, engine=self.name)

    def pull(self, image: str) -> str | None:
        with self.client() as c:
            return docker_images.pull(c, image)

    def tag_image(self, image_id: str, tag: str) -> None:
        with self.client() as c:
            docker_images.tag_image(c, image_id, tag, engine=self.name)

    def remove_image(self, ref: str) -> None:
        with self.client() as c:
            docker_images.remove_image(c, ref)

    def smoke_run(self, image: str, argv: tuple[str, ...]) -> tuple[int | None, str]:
        with self.client() as c:
            return docker_images.smoke_run(c, image, argv, engine=self.name)

    def find(self, *, job_id: str | None = None, root: str | None = None) -> list[Box]:
        with self.client() as c:
            found = find_containers(c, job_id=job_id, root=root)
        return [
            Box(
                id=str(x.id),
                name=str(x.name),
                status=str(x.status),
                labels=dict(x.labels or {}),
                exit_code=(x.attrs.get("State") or {}).get("ExitCode"),
            )
            for x in found
        ]

    def remove(self, box: Box) -> bool:
        with self.client() as c:
            try:
                if not remove_container(c, box.id, leaving=departs(box.labels, box.status)):
                    return False
                if box.labels.get(VOLUME_LABEL):  # the overlay strategy's work/ goes with it
                    remove_volume(c, box.labels[VOLUME_LABEL])
            except DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while removing container {box.name}: {e}") from e
        return True

    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        from . import egress as docker_egress
        from . import hostseal

        with self.client() as c:
            try:
                # After the networks: a seal whose bridge is gone is a killed build's.
                return (
                    docker_egress.sweep(c, root, meta_dir, has_claim)
                    + hostseal.remove_stale()
                    + hostseal.remove_stale_cgroups(root, lambda job: has_claim(job, None))
                )
            except DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping job networks: {e}") from e

    def spare_gateways(self, directory: Path, labels: dict[str, str], *, refill: bool) -> GatewayPool | None:
        with self._lock:  # one pool, whichever thread asks first
            if self.gateways is None:
                self.gateways = GatewayPool(
                    self._spare, self._remove_gateway, directory, labels, refill=refill
                )
            return self.gateways

    def _spare(self, spare: str, network: str, state: Path, labels: dict[str, str]) -> Gateway:
        uid, gid = run_as()
        with self.client() as c:
            return self.spare_maker()(
                c,
                ident=f"spare-{spare}",
                egress_network=network,
                state=state,
                labels=labels,
                uid=uid,
                gid=gid,
            )

    def spare_maker(self) -> Callable[..., Gateway]:
        """How this engine makes a started spare: with the holder of the engine's namespace."""
        from . import egress as docker_egress

        return functools.partial(docker_egress.create, netns=True)

    def _remove_gateway(self, gw: Gateway) -> None:
        from . import egress as docker_egress

        with self.client() as c:
            docker_egress.stop(c, gw)

    def handoff_gateways(self, gateways: list[Gateway], directory: Path) -> bool:
        from . import reap

        with self.client() as c:
            return reap.handoff(c, gateways, directory)

    def sweep_spares(self, root: Path, directory: Path) -> list[str]:
        from . import egress as docker_egress

        with self.client() as c:
            try:
                return docker_egress.sweep_spares(c, root, directory)
            except DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping spare gateways: {e}") from e

    def sweep_volumes(self, root: str) -> list[tuple[str, str | None]]:
        """The daemon refuses to remove a volume a container uses (409), also an exited one's: a
        job's work volume goes only once its container is gone (a volume is made with its
        container, in the same request, so none is ever unused while its job needs it)."""
        gone: list[tuple[str, str | None]] = []
        with self.client() as c:
            try:
                found = c.api.volumes(filters={"label": [f"{LABEL}=1", f"{ROOT_LABEL}={root}"]})
                for v in (found or {}).get("Volumes") or []:
                    try:
                        c.api.remove_volume(v["Name"])
                    except NotFound:
                        continue
                    except APIError as e:
                        if e.status_code == 409:
                            continue  # in use
                        raise
                    gone.append((v["Name"], (v.get("Labels") or {}).get(JOB_LABEL)))
            except DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping fila's volumes: {e}") from e
        return gone

    def runtimes(self) -> list[str]:
        with self.client() as c:
            try:
                return sorted((c.info().get("Runtimes") or {}).keys())
            except DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while listing its runtimes: {e}") from e

    def runtime_for(self, policy: Policy) -> str | None:
        return docker_runtime(policy) if policy.runtime else None

    @contextlib.contextmanager
    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> Iterator[tuple[str, str]]:
        net_name = f"fila-{role}-{os.urandom(4).hex()}"
        labels = {LABEL: "1", "fila.role": role}
        with self.client() as c:
            api = c.api
            cid = None
            try:
                try:
                    net = c.networks.create(net_name, driver="bridge", internal=True, labels=labels)
                    host_config = api.create_host_config(
                        read_only=True,
                        cap_drop=["ALL"],
                        security_opt=["no-new-privileges:true"],
                        mem_limit=64 << 20,
                        pids_limit=32,
                        network_mode=net_name,
                    )
                    networking = api.create_networking_config(
                        {net_name: api.create_endpoint_config(aliases=aliases)}
                    )
                    cid = api.create_container(
                        image,
                        entrypoint=argv,
                        user="65534:65534",
                        labels=labels,
                        host_config=host_config,
                        networking_config=networking,
                    )["Id"]
                    api.start(cid)
                    net.reload()
                    subnet = str(net.attrs["IPAM"]["Config"][0]["Subnet"])
                except DOCKER_ERRORS as e:
                    raise InfraError(f"{self.name} failed while starting the {role} upstream: {e}") from e
                yield net_name, subnet
            finally:
                if cid is not None:
                    with contextlib.suppress(*DOCKER_ERRORS):
                        api.remove_container(cid, force=True)
                with contextlib.suppress(*DOCKER_ERRORS):
                    api.remove_network(net_name)

    def refusal(self, err: BaseException) -> str | None:
        """Docker's own words when it refused a request as malformed (HTTP 400: an invalid image
        reference, a parameter or a limit out of range): the task's fault, not an outage."""
        cause = err.__cause__
        if isinstance(cause, APIError) and cause.status_code == 400:
            return str(cause.explanation or cause)
        return None

    def describe(self) -> dict[str, Any]:
        with self.client() as c:
            try:
                v = c.version()
            except DOCKER_ERRORS as e:
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
        return {"name": self.name, "version": v.get("Version", "?"), "api": v.get("ApiVersion", "?")}
