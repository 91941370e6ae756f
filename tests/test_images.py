"""Engine images against the real daemon: reuse, rebuild on change, CA bundle, errors."""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from pathlib import Path

import docker
import pytest

from fila.assets import shipped_dir
from fila.core.errors import InvalidInput, UnknownEngine
from fila.core.models import ImageRef
from fila.sandbox import images
from fila.sandbox.docker.backend import DockerBackend

pytestmark = pytest.mark.docker

FAKE_CA = "-----BEGIN CERTIFICATE-----\nZmlsYS10ZXN0LWNh\n-----END CERTIFICATE-----\n"


def test_image_tag() -> None:
    assert images.image_tag("shell") == "fila/shell:latest"
    assert "shell" in images.engines()


def test_shell_image_has_the_usual_tools(docker_client, shell_image: ImageRef) -> None:
    tools = "sh sed awk grep find sleep ln mkfifo dd cat printf env xargs sort diff"
    out = docker_client.containers.run(
        shell_image.tag,
        ["sh", "-c", f"for t in {tools}; do command -v $t; done"],
        remove=True,
        network_mode="none",
    ).decode()
    assert len(out.split()) == len(tools.split())


def test_second_ensure_reuses_without_building(docker_client, shell_image: ImageRef) -> None:
    lines: list[str] = []
    t0 = time.monotonic()
    again = images.ensure_image("shell", DockerBackend(docker_client), progress=lines.append)
    assert again == shell_image and lines == []
    assert time.monotonic() - t0 < 2
    lines.clear()
    assert images.build("shell", DockerBackend(docker_client), progress=lines.append) == shell_image
    assert len(lines) == 1 and "up to date" in lines[0]


def test_find_image_missing_is_none(docker_client) -> None:
    assert images.find_image(DockerBackend(docker_client), f"fila/missing-{uuid.uuid4().hex[:8]}:x") is None


def test_unknown_engine(docker_client) -> None:
    with pytest.raises(UnknownEngine) as info:
        images.build("no-such-engine", DockerBackend(docker_client))
    assert info.value.hint and "shell" in info.value.hint


@pytest.fixture
def scratch_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker_client, shell_image):
    """A throwaway copy of the shell engine under its own tag, so tests never touch fila/shell."""
    root = tmp_path / "images"
    name = f"test-{uuid.uuid4().hex[:8]}"
    shutil.copytree(shipped_dir("images") / "shell", root / name)
    monkeypatch.setattr(images, "shipped_dir", lambda kind: root)
    # Like shell, it builds on the local busybox base when busybox:* cannot be pulled.
    monkeypatch.setitem(images.OFFLINE_BASES, name, images.offline_busybox_base)
    yield name, root / name
    with contextlib.suppress(docker.errors.ImageNotFound):
        docker_client.images.remove(images.image_tag(name), force=True)


def test_changed_dockerfile_triggers_rebuild(docker_client, scratch_engine, shell_image) -> None:
    name, src = scratch_engine
    first = images.ensure_image(name, DockerBackend(docker_client), progress=lambda s: None)
    assert images.ensure_image(name, DockerBackend(docker_client), progress=lambda s: None) == first
    with (src / "Dockerfile").open("a") as f:
        f.write('LABEL fila.test="changed"\n')
    lines: list[str] = []
    second = images.ensure_image(name, DockerBackend(docker_client), progress=lines.append)
    assert second.id != first.id and any("Step" in ln for ln in lines)
    labels = docker_client.images.get(second.tag).labels
    assert labels["fila.test"] == "changed"
    assert labels[images.LABEL_CONTEXT] == images.context_hash(src)
    # The replaced image may share its id with fila/shell (same context): that tag must survive.
    assert images.find_image(DockerBackend(docker_client), shell_image.tag) == shell_image


def test_ca_file_is_trusted_in_the_image(docker_client, scratch_engine, tmp_path: Path) -> None:
    name, _ = scratch_engine
    ca = tmp_path / "proxy-ca.pem"
    ca.write_text(FAKE_CA)
    ref = images.build(name, DockerBackend(docker_client), ca_file=ca, progress=lambda s: None)
    out = docker_client.containers.run(
        ref.tag, ["cat", "/etc/ssl/certs/ca-certificates.crt"], remove=True, network_mode="none"
    ).decode()
    assert "ZmlsYS10ZXN0LWNh" in out
    # Same CA again: reused. ensure_image (which knows no CA) keeps it instead of dropping it.
    assert images.build(name, DockerBackend(docker_client), ca_file=ca, progress=lambda s: None) == ref
    assert images.ensure_image(name, DockerBackend(docker_client), progress=lambda s: None) == ref


def test_ca_file_must_be_pem(docker_client, tmp_path: Path) -> None:
    bad = tmp_path / "ca.txt"
    bad.write_text("not a certificate")
    with pytest.raises(InvalidInput):
        images.build("shell", DockerBackend(docker_client), ca_file=bad)


def test_explicit_base_is_used(docker_client, scratch_engine) -> None:
    name, _ = scratch_engine
    base = images.offline_busybox_base(DockerBackend(docker_client), progress=lambda s: None)
    ref = images.build(name, DockerBackend(docker_client), base=base.tag, progress=lambda s: None)
    assert docker_client.images.get(ref.tag).labels[images.LABEL_BASE] == base.tag
