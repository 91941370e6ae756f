"""What an environment's Dockerfile, inputs and state may name (docs/environments.md, "The base",
"Commands"), without containers: the Dockerfile read as the classic builder reads it before the
daemon sees it, the inputs held to the policy's deny rules, a key from an image's label never a
path. The builds themselves: tests/test_env_run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import InvalidEnvironment, InvalidInput
from fila.core.models import Policy
from fila.env import dockerfile
from fila.env.build import envs_dir, refuse_denied_inputs, remove_state, state_dir
from fila.env.spec import EnvSpec
from fila.queue.policy import load_policy
from fila.sandbox.base import ImageInfo
from tests.support.project import make_root

OK = """\
# syntax=docker/dockerfile:1
ARG V=1
FROM base/python:3 AS build
# a comment
RUN apt-get install -y \\
    # a comment inside the continuation
    make \\
    gcc
COPY a /b
COPY ["local dir", "/x"]
FROM scratch
COPY --from=0 /a /a
COPY --from=BUILD /a /c
COPY --from=tools/lint:1 /bin/lint /bin/
HEALTHCHECK --interval=30s --retries=3 CMD true
"""


def test_a_dockerfile_names_only_its_stages_and_local_images_and_nothing_remote() -> None:
    assert dockerfile.references(OK) == [(3, "base/python:3"), (14, "tools/lint:1")]
    # Windows line ends and tabs are text: read as the builder reads them.
    assert dockerfile.references(OK.replace("\n", "\r\n").replace("    make", "\tmake")) == [
        (3, "base/python:3"),
        (14, "tools/lint:1"),
    ]
    bad = {
        "FROM debian\nADD https://example.com/x.tgz /x\n": "fetched by the daemon",
        "FROM debian\nADD \\\n  http://h/$SECRET /x\n": "fetched by the daemon",
        'FROM debian\nADD ["git@github.com:a/b.git", "/b"]\n': "fetched by the daemon",
        "FROM debian\nadd $URL /x\n": "fetched by the daemon",
        "ARG B=debian\nFROM $B\n": "with a variable",
        "FROM debian\nCOPY --from=${IMG} /a /b\n": "with a variable",
        "FROM debian\nCOPY --from=1 /a /b\n": "stage 1 is not finished",
        "FROM debian\nRUN --mount=type=bind,from=fila/env:x,target=/m cat /m\n": "flag --mount",
        "FROM debian\nRUN --network=host curl x\n": "flag --network",
        "FROM debian\nONBUILD ADD http://h/x /x\n": "'ONBUILD' is not one fila reads",
        "# escape=`\nFROM debian\nADD `\n  http://h/x /x\n": "escape",
        # What the daemon's word processing undoes (quotes, escapes) is refused, not undone: the
        # daemon would fetch each of these (the audit's proofs, tests/test_env_run.py).
        'FROM debian\nADD "http://h/x" /x\n': "fetched by the daemon",
        "FROM debian\nADD 'http://h/x' /x\n": "fetched by the daemon",
        "FROM debian\nADD http\\://h/x /x\n": "fetched by the daemon",
        "FROM debian\nADD h\\ttp://h/x /x\n": "fetched by the daemon",
        'FROM debian\nADD ["h\\\\ttp://h/x", "/x"]\n': "fetched by the daemon",
        'FROM "debian"\n': "a quote or an escape",
        # Python breaks lines at these, the builder only at \n: read two ways, so refused.
        "FROM debian\nRUN echo \\\x1cADD http://h/x /x\n": "control character U+001C",
        "FROM debian\nRUN echo \\\x0cADD http://h/x /x\n": "control character U+000C",
        "FROM debian\nRUN echo \\\u2028ADD http://h/x /x\n": "control character U+2028",
    }
    # Read differently by the builder than by Python (the second audit's proofs): a backslash then a
    # no-break space continues a line for Python's rstrip, not for the builder; a JSON array with
    # text after it is the JSON form for the builder only; a stage index in other digits.
    bad |= {
        "FROM debian\nRUN true \\\u00a0\nADD http://h/x /x\n": "fetched by the daemon",
        "FROM debian\nRUN true \\\r\r\nADD http://h/x /x\n": "carriage return",
        'FROM debian\nADD ["http://h/x","/x"]z\n': "not the whole of its arguments",
        "FROM debian\nCOPY --from=\u00b2 /a /b\n": "not plain",
        "FROM debian\nVOLUME /data\n": "VOLUME is refused",
        # A local archive the daemon would unpack outside the measured steps (COPY it instead).
        "FROM debian\nADD vendor.tar.gz /opt/\n": "ADD is refused",
        # A stage is the builder's once finished: `--from` naming the current one is an image.
        "FROM debian AS hello\nCOPY --from=hello /a /b\n": "",
        "FROM debian\nCOPY --from=0 /a /b\n": "stage 0 is not finished",
        "FROM debian\nCOPY --chmod=777 a /b\n": "flag --chmod",
        "FROM --platform=linux/amd64 debian\n": "flag --platform",
    }
    bad.pop("FROM debian AS hello\nCOPY --from=hello /a /b\n")
    assert dockerfile.references("FROM debian AS hello\nCOPY --from=hello /a /b\n") == [
        (1, "debian"),
        (2, "hello"),  # an image to check against the policy, as the builder would take it
    ]
    for text, said in bad.items():
        with pytest.raises(InvalidEnvironment) as e:
            dockerfile.references(text)
        assert said in str(e.value), (text, str(e.value))
    with pytest.raises(InvalidEnvironment, match="not UTF-8"):
        dockerfile.decode(b"FROM debian\nCOPY \xa0--from=fila/gateway:latest /etc/os-release /x\n")


def test_the_daemon_is_given_the_dockerfile_as_fila_read_it() -> None:
    """One instruction a line, no directive, comment or continuation; COPY and ADD in the JSON form
    of the arguments fila checked; RUN as written (its quoting kept): whatever the original's
    spelling, the builder cannot read another Dockerfile than the one fila checked."""
    text = dockerfile.canonical(OK.replace("    make", "\tmake") + 'RUN echo "a  b" \\ \n  && true\n')
    assert text.splitlines() == [
        "ARG V=1",
        "FROM base/python:3 AS build",
        "RUN apt-get install -y \tmake     gcc",
        'COPY ["a", "/b"]',
        'COPY ["local dir", "/x"]',
        "FROM scratch",
        'COPY --from=0 ["/a", "/a"]',
        'COPY --from=BUILD ["/a", "/c"]',
        'COPY --from=tools/lint:1 ["/bin/lint", "/bin/"]',
        "HEALTHCHECK --interval=30s --retries=3 CMD true",
        'RUN echo "a  b"   && true',
    ]
    assert [ref for _n, ref in dockerfile.references(text)] == ["base/python:3", "tools/lint:1"]


class _Local:
    """The daemon's view of which images are present (all but `absent`)."""

    name = "docker"

    def __init__(self, absent: str = "") -> None:
        self.absent = absent

    def image_info(self, ref: str) -> ImageInfo | None:
        triggers = ["ADD http://h/x /x"] if ref.startswith("base/onbuild") else []
        return None if ref == self.absent else ImageInfo(id="sha256:" + "a" * 64, labels={}, tags=[ref],
                                                         onbuild=triggers)  # fmt: skip


def test_an_image_is_a_base_only_when_local_allowed_and_not_filas_own() -> None:
    policy = Policy(images=["fila/*", "base/*"], max_timeout_ms=1000, default_timeout_ms=1000)
    backend: Any = _Local(absent="base/missing")
    assert dockerfile.local_image(policy, backend, "base/python:3", "here").id.startswith("sha256:")
    assert dockerfile.local_image(policy, backend, "fila/shell:latest", "here")
    for internal in ("fila/env:0123", "fila/env-base:ab", "fila/env-claude:ab", "fila/gateway:latest",
                     "docker.io/fila/env:1", "fila/env@sha256:" + "b" * 64):  # fmt: skip
        with pytest.raises(InvalidInput, match="never are"):
            dockerfile.local_image(policy, backend, internal, "here")
    with pytest.raises(InvalidInput, match="not allowed by the policy"):
        dockerfile.local_image(policy, backend, "other/x", "here")
    with pytest.raises(InvalidInput, match="is not present in docker"):
        dockerfile.local_image(policy, backend, "base/missing", "here")
    with pytest.raises(InvalidInput, match="has ONBUILD triggers"):
        dockerfile.local_image(policy, backend, "base/onbuild:1", "here")


def test_an_input_the_policy_denies_to_jobs_is_not_given_to_the_setup(tmp_path: Path) -> None:
    root = make_root(tmp_path / "p")
    policy, _ref = load_policy(root, "default")
    for rel, text in {"package.json": "{}", ".env": "TOKEN=x", ".npmrc": "//r/:_authToken=x"}.items():
        (root.path / rel).write_text(text)
    refuse_denied_inputs(root, root.path, EnvSpec(image="x", inputs=["package.json"]), policy)
    for rel in (".env", ".git/config", ".npmrc"):
        with pytest.raises(InvalidInput, match="kept from every job"):
            refuse_denied_inputs(root, root.path, EnvSpec(image="x", inputs=["package.json", rel]), policy)


def test_a_key_from_a_label_never_names_a_directory_outside_the_roots_environments(tmp_path: Path) -> None:
    root = make_root(tmp_path / "r")
    victim = tmp_path / "victim"
    victim.mkdir()
    key = "0123456789abcdef" * 4
    state_dir(root, key).mkdir(parents=True)
    remove_state(root, key)
    assert not state_dir(root, key).exists() and envs_dir(root).is_dir()
    for bad in ("../../../victim", "../victim" + "0" * 60, key.upper(), key[:63], ""):
        with pytest.raises(InvalidInput, match="not an environment's key"):
            remove_state(root, bad)
    assert victim.is_dir()
