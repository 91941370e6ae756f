"""Connections to the Docker daemon (DOCKER_HOST honoured), and the errors the SDK raises
(docs/architecture.md, "Layers")."""

from __future__ import annotations

import docker
import requests
from docker.errors import DockerException

from ...core.errors import EngineUnavailable

DOCKER_ERRORS = (DockerException, requests.RequestException)


def docker_client(
    timeout: float = 60, *, version: str | None = None, check: bool = True
) -> docker.DockerClient:
    """A client for the local daemon (DOCKER_HOST honoured), checked: without `version`, by its
    first request (GET /version, the API version it then speaks: a ping would only repeat that
    the daemon answers); with one, by a ping unless not `check` (then it asks nothing)."""
    client = None
    try:
        client = docker.from_env(timeout=timeout, version=version)
        if version is not None and check:
            client.ping()
        return client
    except DOCKER_ERRORS as e:
        if client is not None:
            client.close()
        denied = "Permission denied" in str(e)
        raise EngineUnavailable(
            f"the Docker daemon does not answer: {e}",
            hint="add your user to the docker group (or use rootless Docker)"
            if denied
            else "start Docker (e.g. `systemctl start docker`) or set DOCKER_HOST",
        ) from e


def socket_path(client: docker.DockerClient) -> str | None:
    """The Unix socket `client` reaches its daemon by (a daemon on this host, on this host's
    clock), or None (a TCP, TLS or SSH context)."""
    adapter = client.api.get_adapter(client.api.base_url)
    path = getattr(adapter, "socket_path", None)
    return path if isinstance(path, str) and path else None


def fresh_client(client: docker.DockerClient) -> docker.DockerClient:
    """A new connection to the same daemon: the interrupted client may be mid-request."""
    if (path := socket_path(client)) is not None:
        return docker.DockerClient(base_url=f"unix://{path}", version=client.api.api_version, timeout=30)
    return docker.from_env(version=client.api.api_version, timeout=30)
