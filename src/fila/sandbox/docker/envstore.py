"""What a project environment keeps in the Docker engine besides its images: the volumes of its
provided paths, filled once from the environment's image (docs/environments.md, "Provided
paths"), the listing of images and volumes by label that `fila env ls|rm|gc` reads, and the
gateway a project Dockerfile's build reaches the network through."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import docker
import requests
from docker.errors import DockerException, NotFound

from ...core.errors import InfraError
from ...core.models import EgressRecord, Policy
from ..base import ImageInfo, run_as

_ERRORS = (DockerException, requests.RequestException)
_HINT = "check that Docker is running (`docker info`)"


def fill_volume(
    client: docker.DockerClient,
    image: str,
    source: str,
    name: str,
    labels: dict[str, str],
    *,
    max_bytes: int,
) -> None:
    """A new volume `name` holding what `image` has at `source`: the one copy of a provided path,
    shared read-only by every job of the environment. No code of the image runs (the setup could
    have replaced its `sh`): the daemon reads `source` from a container that is created but never
    started and writes it into the volume mounted on another, up to `max_bytes`
    (environment.max_image_bytes). A volume of that name already there is refused: each build
    names its own (env/build.volume_name)."""
    own = {**labels, "fila": "1", "fila.role": "env-fill"}
    made: list[str] = []
    try:
        with contextlib.suppress(NotFound):
            client.api.inspect_volume(name)
            raise InfraError(f"volume {name} exists already: not this build's to fill", hint=_HINT)
        client.api.create_volume(name=name, labels=labels)
        base = PurePosixPath(source).name
        common: dict[str, Any] = dict(network_disabled=True, labels=own)
        src = client.api.create_container(image, command=["true"], **common)["Id"]
        made.append(src)
        dst = client.api.create_container(
            image,
            command=["true"],
            host_config=client.api.create_host_config(
                mounts=[docker.types.Mount(f"/fila-volume/{base}", name, type="volume", no_copy=True)],
                network_mode="none",
            ),
            **common,
        )["Id"]
        made.append(dst)
        stream, _stat = client.api.get_archive(src, source)
        counted = _Capped(stream, max_bytes)
        try:
            client.api.put_archive(dst, "/fila-volume", counted)
        except _ERRORS:
            if counted.over:
                raise InfraError(
                    f"{source} of {image} is over environment.max_image_bytes ({max_bytes} bytes): "
                    f"not copied into volume {name}",
                    hint="make the setup write less, or raise the policy's environment.max_image_bytes",
                ) from None
            raise
    except _ERRORS as e:
        raise InfraError(f"docker failed while filling volume {name} from {source}: {e}", hint=_HINT) from e
    finally:
        for cid in made:
            with contextlib.suppress(*_ERRORS):
                client.api.remove_container(cid, force=True)


class _Capped:
    """The archive's chunks, stopped once more than `cap` bytes went by (`over` says so)."""

    def __init__(self, chunks: Iterator[bytes], cap: int) -> None:
        self.chunks, self.cap, self.seen, self.over = chunks, cap, 0, False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.seen += len(chunk)
            if self.seen > self.cap:
                self.over = True
                raise requests.RequestException("over the byte cap")
            yield chunk


def labelled_images(client: docker.DockerClient, label: str) -> list[ImageInfo]:
    try:
        found = client.images.list(filters={"label": label})
    except _ERRORS as e:
        raise InfraError(f"docker failed while listing images: {e}", hint=_HINT) from e
    return [
        ImageInfo(
            id=str(i.id),
            labels=dict(i.labels or {}),
            tags=list(i.tags or []),
            size=int(i.attrs.get("Size") or 0),
        )
        for i in found
    ]


def labelled_volumes(client: docker.DockerClient, label: str) -> list[dict[str, Any]]:
    try:
        return list(client.api.volumes(filters={"label": label}).get("Volumes") or [])
    except _ERRORS as e:
        raise InfraError(f"docker failed while listing volumes: {e}", hint=_HINT) from e


def remove_volume(client: docker.DockerClient, name: str) -> bool:
    """False when a container still uses it (a running job): it stays, for a later gc."""
    try:
        client.api.remove_volume(name, force=False)
        return True
    except NotFound:
        return True
    except docker.errors.APIError as e:
        if e.status_code == 409:
            return False
        raise InfraError(f"docker failed while removing volume {name}: {e}", hint=_HINT) from e
    except _ERRORS as e:
        raise InfraError(f"docker failed while removing volume {name}: {e}", hint=_HINT) from e


@dataclasses.dataclass
class BuildGateway:
    """A gateway in front of a project Dockerfile's RUN steps (docs/environments.md, "A project
    Dockerfile"): the job network the build's steps join, the proxy variables they are given as
    build args, and, once the build is over, what the gateway saw."""

    network: str
    env: dict[str, str]
    egress: EgressRecord | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def build_gateway(
    client: docker.DockerClient, *, job_id: str, policy: Policy, state: Path, labels: dict[str, str]
) -> Iterator[BuildGateway]:
    """A gateway of its own for one build, as a setup container's (the policy's allowlist, its
    record, its job network internal, the gateway its only way out), serving before the build
    starts, the job network's bridge closed to the host (hostseal: the caller checked
    hostseal.refusal); after it, whatever the build did, halted (nothing a step left queued
    passes once its log is read: egress.halt, as after a job's engine), read and removed."""
    from . import egress, hostseal

    uid, gid = run_as()
    gw = egress.start(client, job_id=job_id, policy=policy, state=state, labels=labels, uid=uid, gid=gid)
    out = BuildGateway(network=gw.network, env=gw.engine_env())
    try:
        # The RUN steps keep NET_RAW: the host is closed to their bridge before the first one.
        with hostseal.sealed(hostseal.bridge_of(client, gw.network), job_id):
            yield out
    finally:
        try:
            egress.halt(client, gw)
            out.egress, out.warnings = egress.read(client, gw)
        finally:
            out.warnings += egress.remove(client, gw)
