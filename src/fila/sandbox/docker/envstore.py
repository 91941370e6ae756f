"""What a project environment keeps in the Docker engine besides its images: the volumes of its
provided paths, filled once from the environment's image (docs/environments.md, "Provided
paths"), and the listing of images and volumes by label that `fila env ls|rm|gc` reads."""

from __future__ import annotations

import contextlib
from typing import Any

import docker
import requests
from docker.errors import DockerException, NotFound

from ...core.errors import InfraError
from ..base import ImageInfo

_ERRORS = (DockerException, requests.RequestException)
FILL_TIMEOUT_S = 1800
_HINT = "check that Docker is running (`docker info`)"


def fill_volume(
    client: docker.DockerClient, image: str, source: str, name: str, labels: dict[str, str]
) -> None:
    """A new volume `name` holding what `image` has at `source` (cp -a, as root, no network): the
    one copy of a provided path, shared read-only by every job of the environment. A volume of
    that name already there is replaced (a fill that died half way leaves one)."""
    try:
        with contextlib.suppress(NotFound):
            client.api.remove_volume(name, force=True)
        client.api.create_volume(name=name, labels=labels)
        c = client.containers.create(
            image,
            ["-c", 'cp -a -- "$1"/. /fila-volume/', "fila-fill", source],
            entrypoint=["/bin/sh"],
            user="0:0",
            network_mode="none",
            cap_drop=["ALL"],
            cap_add=["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID"],
            security_opt=["no-new-privileges:true"],
            mounts=[docker.types.Mount("/fila-volume", name, type="volume", no_copy=True)],
            labels={**labels, "fila": "1", "fila.role": "env-fill"},
        )
        try:
            c.start()
            code = int(c.wait(timeout=FILL_TIMEOUT_S)["StatusCode"])
            if code != 0:
                out = c.logs(stdout=True, stderr=True).decode(errors="replace")[-500:]
                raise InfraError(
                    f"could not copy {source} of {image} into volume {name} (exit {code}): {out}", hint=_HINT
                )
        finally:
            c.remove(force=True)
    except _ERRORS as e:
        raise InfraError(f"docker failed while filling volume {name}: {e}", hint=_HINT) from e


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
