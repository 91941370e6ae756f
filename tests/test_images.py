"""Engine images against the real daemon: reuse, rebuild on change, CA bundle, errors."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path

import docker
import pytest

from fila.assets import shipped_dir
from fila.core.errors import ImageMissing, InvalidInput, UnknownEngine
from fila.core.models import ImageRef
from fila.sandbox import images
from fila.sandbox.docker.backend import DockerBackend

pytestmark = pytest.mark.docker

FAKE_CA = "-----BEGIN CERTIFICATE-----\nZmlsYS10ZXN0LWNh\n-----END CERTIFICATE-----\n"


def test_an_engines_image_is_tagged_fila_engine_latest() -> None:
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


def test_the_shell_images_wget_takes_a_timeout(docker_client, shell_image: ImageRef) -> None:
    # A refused connection is reported (exit 1) and a server that never answers is given up after
    # -T's second (`timeout` ends a wget that ignored it: 143), where a wget without -T crashed (139).
    script = (
        "wget -T 1 -q -O- http://127.0.0.1:9/; echo refused=$?; "
        "sleep 30 | nc -l -p 8000 >/dev/null & sleep 0.3; "
        "timeout 20 wget -T 1 -q -O- http://127.0.0.1:8000/; echo silent=$?"
    )
    out = docker_client.containers.run(
        shell_image.tag, ["sh", "-c", script], remove=True, network_mode="none", stderr=True
    ).decode()
    assert "refused=1" in out and "silent=1" in out and "timed out" in out, out


def test_second_ensure_reuses_without_building(docker_client, shell_image: ImageRef) -> None:
    lines: list[str] = []
    again = images.ensure_image("shell", DockerBackend(docker_client), progress=lines.append)
    assert again == shell_image and lines == []  # no build step reported: nothing was built
    lines.clear()
    assert images.build("shell", DockerBackend(docker_client), progress=lines.append) == shell_image
    assert len(lines) == 1 and "up to date" in lines[0]


def test_find_image_missing_is_none(docker_client) -> None:
    assert images.find_image(DockerBackend(docker_client), f"fila/missing-{uuid.uuid4().hex[:8]}:x") is None


def test_building_an_unknown_engine_is_refused_naming_the_known_ones(docker_client) -> None:
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


def test_a_build_shows_a_line_per_step_with_what_it_fetches_and_the_raw_stream_only_when_verbose() -> None:
    dockerfile = (shipped_dir("images") / "claude" / "Dockerfile").read_text()
    raw = [
        "Step 2/15 : FROM ${BASE} AS fetch",
        " ---> 5d1e6f0b1c2a",
        "Step 5/15 : RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl",
        "Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]",
        'Step 8/15 : RUN set -e;     curl -fsSL --retry 3 -o /tmp/pkg.tgz "$TARBALL";     tar -xzf x',
        "[2/2] STEP 3/8: RUN pip install --no-cache-dir aider-chat==0.86.2",
    ]
    lines: list[str] = []
    out = images.BuildProgress("fila/claude:latest", dockerfile, lines.append, buildargs={"BASE": "b:1"})
    for line in raw:
        out(line)
    assert lines == [
        "fila/claude:latest: Step 2/15, stage 1 (fetch): FROM b:1 AS fetch",
        "fila/claude:latest: Step 5/15, stage 1 (fetch): RUN (fetching: apt-get install "
        "ca-certificates curl)",
        "fila/claude:latest: Step 8/15, stage 1 (fetch): RUN (fetching: https://registry.npmjs.org/"
        "@anthropic-ai/claude-code-linux-x64/-/claude-code-linux-x64-2.1.332.tgz)",
        "fila/claude:latest: Step 3/8, stage 1 (fetch): RUN (fetching: pip install aider-chat==0.86.2)",
    ]
    verbose: list[str] = []
    out = images.BuildProgress("fila/claude:latest", dockerfile, verbose.append, verbose=True)
    for line in raw:
        out(line)
    # The tail kept for a failure's error leaves out layer ids.
    assert verbose == raw and out.tail == [ln for ln in raw if "--->" not in ln]


@pytest.mark.parametrize(
    "said",
    [
        "curl: (60) SSL certificate problem: unable to get local issuer certificate",
        "npm ERR! code SELF_SIGNED_CERT_IN_CHAIN",
        "npm error code UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
        "SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed'))",
        "The command '/bin/sh -c curl -fsSL -o /tmp/pkg.tgz $TARBALL' returned a non-zero code: 60",
    ],
)
def test_an_untrusted_certificate_is_recognised_in_curls_npms_and_pips_words(said: str) -> None:
    assert images.untrusted_tls(said)
    assert not images.untrusted_tls("E: Unable to locate package nope")  # the counterpart


def test_a_build_failing_on_an_untrusted_certificate_names_ca_file_and_the_hosts_bundle(
    docker_client, scratch_engine
) -> None:
    name, src = scratch_engine
    with (src / "Dockerfile").open("a") as f:  # what curl says and does behind an intercepting proxy
        f.write("RUN echo 'curl: (60) SSL certificate problem: unable to get local issuer certificate' >&2;")
        f.write(" exit 60\n")
    lines: list[str] = []
    with pytest.raises(ImageMissing) as info:
        images.build(name, DockerBackend(docker_client), progress=lines.append)
    hint = info.value.hint or ""
    assert f"fila images build {name} --ca-file" in hint, hint
    if images.HOST_CA_BUNDLE.is_file():
        assert str(images.HOST_CA_BUNDLE) in hint
    # The failed step and curl's own words are in the error, though the progress showed only steps.
    assert "SSL certificate problem" in info.value.message and "Step" in info.value.message
    assert any(ln.startswith(f"fila/{name}:latest: Step ") for ln in lines), lines
    # No raw stream: curl's words are shown only in the step that runs it, not as its output line.
    assert not any(ln.startswith("curl: (60)") for ln in lines), lines


def test_images_build_takes_root_like_every_command(tmp_path: Path) -> None:
    from tests.support.cli import fila

    res = fila(tmp_path, "images", "build", "no-such-engine")  # `--root` is appended
    assert res.exit_code == 2 and "unknown engine" in res.output and "No such option" not in res.output, (
        res.output
    )
