"""Image primitives on the Docker API (also Podman's compatible one): look up, build a context,
import a root filesystem, pull, tag, remove, and run a smoke check. sandbox/images.py decides what to
build and when; this module only talks to the engine, and turns its errors into fila's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import docker
import requests
import urllib3
from docker.errors import DockerException, ImageNotFound

from ...core.errors import ImageMissing, InfraError, LimitExceeded
from ..base import ImageInfo

_ERRORS = (DockerException, requests.RequestException)
BUILD_READ_TIMEOUT_S = 900  # between two progress lines; a hung build must not hang fila forever
SMOKE_TIMEOUT_S = 120


# What a person checks when Docker failed a call; the Podman backend puts its own in their place
# (`podman info`, the socket it used: PodmanBackend.client).
RUN_HINT = "check `docker info`; the task can be retried once Docker is healthy"
IMAGE_HINT = "check that Docker is running (`docker info`)"
HEALTH_HINTS = (RUN_HINT, IMAGE_HINT)


def _infra(engine: str, action: str, err: BaseException, **kw: Any) -> InfraError:
    return InfraError(f"{engine} failed while {action}: {err}", hint=IMAGE_HINT, **kw)


def image_info(client: docker.DockerClient, tag: str, *, engine: str = "docker") -> ImageInfo | None:
    try:
        img = client.images.get(tag)
    except ImageNotFound:
        return None
    except _ERRORS as e:
        raise _infra(engine, f"looking up image {tag}", e) from e
    config = img.attrs.get("Config") or {}
    return ImageInfo(
        id=str(img.id),
        labels=dict(img.labels or {}),
        tags=list(img.tags or []),
        env=list(config.get("Env") or []),
        size=int(img.attrs.get("Size") or 0),
        onbuild=[str(t) for t in config.get("OnBuild") or []],
    )


def build_context(
    client: docker.DockerClient,
    context: Path,
    tag: str,
    *,
    buildargs: dict[str, str],
    labels: dict[str, str],
    nocache: bool,
    progress: Callable[[str], None],
    engine: str = "docker",
    network_mode: str | None = None,
    dockerfile: str | None = None,
    target: str | None = None,
    limits: dict[str, int] | None = None,
    deadline_s: float | None = None,
    cgroup_parent: str | None = None,
) -> None:
    """`context`: a directory, or a tar that is the whole context as sent (a project's, assembled
    by fila: env/dockerfile.archive). `limits`: each RUN step's container_limits (memory,
    memswap, cpushares); `deadline_s`: the whole build's wall clock, after which fila drops the
    connection (the daemon then cancels the build) and raises LimitExceeded. `cgroup_parent`: the
    cgroup every RUN step's container is made under (the Engine API's `cgroupparent`, which the
    SDK's build does not take: sent as a query parameter of this client's session, which the
    caller holds alone for the build)."""
    tar = context.open("rb") if context.is_file() else None
    end = None if deadline_s is None else time.monotonic() + deadline_s
    params = client.api.params
    if cgroup_parent is not None:
        client.api.params = {**(params or {}), "cgroupparent": cgroup_parent}
    try:
        chunks: Iterable[dict[str, Any]] = client.api.build(
            path=None if tar else str(context),
            fileobj=tar,
            custom_context=tar is not None,
            dockerfile=dockerfile,
            target=target,
            tag=tag,
            buildargs=buildargs,
            labels=labels,
            rm=True,
            forcerm=True,
            pull=False,
            nocache=nocache,
            decode=True,
            timeout=BUILD_READ_TIMEOUT_S if deadline_s is None else min(BUILD_READ_TIMEOUT_S, deadline_s),
            network_mode=network_mode,
            container_limits=limits,
        )
        for chunk in chunks:
            if end is not None and time.monotonic() > end:
                chunks.close()  # type: ignore[attr-defined]
                raise LimitExceeded(f"building {tag} took longer than {deadline_s:g} s")
            if "error" in chunk:
                raise ImageMissing(
                    f"building {tag} failed: {str(chunk['error']).strip()}",
                    hint="the build's last lines say why (all of them with --verbose); fix the "
                    "Dockerfile or pass --base IMAGE",
                )
            text = chunk.get("stream") or chunk.get("status") or ""
            for line in str(text).splitlines():
                if line.strip():
                    progress(line.rstrip())
    except (*_ERRORS, urllib3.exceptions.HTTPError) as e:  # urllib3's: a read past the deadline
        if end is not None and time.monotonic() > end - 1:
            raise LimitExceeded(f"building {tag} took longer than {deadline_s:g} s") from None
        raise _infra(engine, f"building {tag}", e) from e
    finally:
        client.api.params = params
        if tar is not None:
            tar.close()


def import_image(
    client: docker.DockerClient, archive: Path, tag: str, changes: list[str], *, engine: str = "docker"
) -> None:
    repo, _, name = tag.partition(":")
    try:
        client.api.import_image(src=str(archive), repository=repo, tag=name, changes=changes)
    except _ERRORS as e:
        raise _infra(engine, f"importing {tag}", e) from e


def pull(client: docker.DockerClient, image: str) -> str | None:
    """None when pulled, else why not (one line)."""
    try:
        client.images.pull(image)
        return None
    except _ERRORS as e:
        return str(e).splitlines()[0][-200:]


def tag_image(client: docker.DockerClient, image_id: str, tag: str, *, engine: str = "docker") -> None:
    repo, _, name = tag.rpartition(":")
    try:
        client.api.tag(image_id, repo, name)
    except _ERRORS as e:
        raise _infra(engine, f"tagging {image_id[:19]} as {tag}", e) from e


def remove_image(client: docker.DockerClient, ref: str) -> None:
    """Best effort: refused (409) while a container still uses it, and gone is fine."""
    with contextlib.suppress(*_ERRORS):
        client.images.remove(ref)


def smoke_run(
    client: docker.DockerClient, image: str, argv: tuple[str, ...], *, engine: str = "docker"
) -> tuple[int | None, str]:
    """`argv` in the image as fila runs an engine: uid 65534, read-only root, tmpfs /tmp and HOME,
    no network, no capabilities. (exit code, stdout+stderr); None when it did not finish in time."""
    try:
        c = client.containers.create(
            image,
            list(argv),
            user="65534:65534",
            read_only=True,
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            tmpfs={
                "/tmp": "rw,nosuid,nodev,size=64m",
                "/home/fila": "rw,nosuid,nodev,size=64m,uid=65534,gid=65534",
            },
            working_dir="/job",
            environment={"HOME": "/home/fila", "CI": "1", "TERM": "dumb", "NO_COLOR": "1"},
            labels={"fila": "1", "fila.role": "smoke"},
        )
    except _ERRORS as e:
        raise _infra(engine, f"creating a smoke-test container of {image}", e) from e
    try:
        c.start()
        try:
            code: int | None = int(c.wait(timeout=SMOKE_TIMEOUT_S)["StatusCode"])
        except requests.RequestException:
            code = None
        return code, c.logs(stdout=True, stderr=True).decode(errors="replace")
    except _ERRORS as e:
        raise _infra(engine, f"smoke-testing {image}", e) from e
    finally:
        with contextlib.suppress(*_ERRORS):
            c.remove(force=True)
