"""fila's containers found and removed by label, whatever process made them (docs/architecture.md,
"On disk": the labels let recovery sweep what a crashed worker left)."""

from __future__ import annotations

import docker
from docker.models.containers import Container

from ...core.errors import InfraError
from ..base import JOB_LABEL, LABEL, ROOT_LABEL
from .client import DOCKER_ERRORS
from .removal import departs, remove_container


def _label_filters(job_id: str | None, root: str | None) -> dict[str, list[str]]:
    labels = [f"{LABEL}=1"]
    if job_id is not None:
        labels.append(f"{JOB_LABEL}={job_id}")
    if root is not None:
        labels.append(f"{ROOT_LABEL}={root}")
    return {"label": labels}


def find_containers(
    client: docker.DockerClient, *, job_id: str | None = None, root: str | None = None
) -> list[Container]:
    """fila's containers in any state, by label (of one job, one queue root, or all)."""
    try:
        return client.containers.list(all=True, filters=_label_filters(job_id, root), ignore_removed=True)
    except DOCKER_ERRORS as e:
        raise InfraError(f"Docker failed while listing fila's containers: {e}") from e


def remove_containers(
    client: docker.DockerClient, *, job_id: str | None = None, root: str | None = None
) -> list[str]:
    """Force-remove fila's containers by label; returns the ids removed."""
    removed = []
    for c in find_containers(client, job_id=job_id, root=root):
        try:
            remove_container(client, c.id, leaving=departs(c.labels or {}, c.status))
        except DOCKER_ERRORS as e:
            raise InfraError(f"Docker failed while removing container {c.name}: {e}") from e
        removed.append(c.id)
    return removed
