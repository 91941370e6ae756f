"""Local package indexes for the environment tests: `pypi.test` (pypiserver, port 8080) and
`npm.test` (verdaccio with no uplinks, port 4873), and on demand `private.test` (pypiserver that
answers one user: `private_pypi`, a setup route's registry), from the fila/pkgindex image, on the test
upstreams' sealed network (tests/upstreams/README.md), so a project's setup installs real
packages and no test reaches a public registry.

The indexes join the upstreams' network rather than one of their own: it is `--internal`, has no
IPv4 on the host's side and is proven sealed by a probe before any server starts; and a job's
gateway then reaches the model server and the indexes on the one egress network a policy names
(`egress.egress_network = upstreams.network`, `egress.allow_private = [upstreams.subnet]`).
Their containers carry the upstreams' session label, so the upstreams' teardown (and the sweep of
a killed session) removes whatever this module did not.

What they serve is fixed at image build: images/pkgindex/wheels.txt (pytest and its dependencies
for Python 3.11, six, setuptools, wheel) and images/pkgindex/npm-seeds.txt (uvu and its
dependencies, ms). A name they do not hold is a 404, never a redirect or a proxied request.

Reached through a job's gateway (plain HTTP through its proxy door, as pip and npm send it with
HTTP_PROXY set): the policy's `egress.allow` takes `PkgIndex.allow()`, `egress.allow_private`
takes `PkgIndex.subnet`, `egress.egress_network` is `PkgIndex.network`; the setup's environment
takes `PkgIndex.pip_env` and `PkgIndex.npm_env`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from fila.core.models import ImageRef
from fila.sandbox.docker.backend import DockerBackend
from fila.sandbox.images import build
from tests.upstreams.fixtures import (
    HARDENED,
    LABEL,
    LABEL_VALUE,
    READY_TIMEOUT_S,
    RunResult,
    Upstreams,
    run_container,
)

PYPI = "pypi.test"
NPM = "npm.test"
PRIVATE = "private.test"
PORTS = {PYPI: 8080, NPM: 4873, PRIVATE: 8080}
SERVICE = {PYPI: "pypi", NPM: "npm"}  # the image entrypoint's argument
# Where each answers once it serves: pypiserver's health endpoint, verdaccio's ping.
READY_PATH = {PYPI: "/health", NPM: "/-/ping", PRIVATE: "/health"}
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")

# A client container of the tests (fila/testenv: pip, npm): the upstreams' hardening, with room
# for a venv or node_modules in its home and for npm's memory.
CLIENT: dict[str, Any] = {
    "tmpfs": {
        "/tmp": "rw,nosuid,nodev,size=64m",
        "/home/fila": "rw,nosuid,nodev,exec,size=256m,uid=65534,gid=65534",
    },
    "mem_limit": "1g",
}

# Run in the index's own container: waits until its HTTP endpoint answers 200 (exit 0) or the
# deadline passes (exit 1), in one exec.
_READY = r"""
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            sys.exit(0 if r.status == 200 else 1)
    except OSError as e:
        if time.monotonic() > deadline:
            print(e, file=sys.stderr)
            sys.exit(1)
        time.sleep(0.1)
"""


@dataclass(frozen=True)
class Index:
    alias: str  # the name it answers to on the network: pypi.test or npm.test
    ip: str
    port: int
    container: str

    @property
    def url(self) -> str:
        return f"http://{self.alias}:{self.port}"


@dataclass
class PkgIndex:
    """What the `pkgindex` fixture yields: the two indexes, their network and a client."""

    network: str  # the upstreams' network: attach a gateway (or a client) here
    subnet: str  # its CIDR: a gateway's `allow_private`
    pypi: Index
    npm: Index
    session: str
    testenv_image: str  # fila/testenv:latest, built: "the project's own image"
    docker: docker.DockerClient = field(repr=False)

    @property
    def pypi_url(self) -> str:
        """The simple index pip takes (`pip install --index-url ...`, PIP_INDEX_URL)."""
        return f"{self.pypi.url}/simple/"

    @property
    def npm_url(self) -> str:
        """The registry npm takes (`npm install --registry ...`, npm_config_registry)."""
        return f"{self.npm.url}/"

    @property
    def pip_env(self) -> dict[str, str]:
        """pip's environment for pypi.test: the index, trusted over plain HTTP (pip refuses an
        http index on any host but localhost otherwise), no version check."""
        return {
            "PIP_INDEX_URL": self.pypi_url,
            "PIP_TRUSTED_HOST": self.pypi.alias,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }

    @property
    def npm_env(self) -> dict[str, str]:
        """npm's environment for npm.test: the registry; no update check, audit or funding
        requests; its cache in the client's home."""
        return {
            "npm_config_registry": self.npm_url,
            "npm_config_update_notifier": "false",
            "npm_config_audit": "false",
            "npm_config_fund": "false",
            "npm_config_cache": "/home/fila/.npm",
        }

    @property
    def hosts(self) -> dict[str, str]:
        """Each index's name and IPv4, for a container that is not on the network itself."""
        return {i.alias: i.ip for i in (self.pypi, self.npm)}

    def allow(self) -> list[dict[str, Any]]:
        """The policy's `egress.allow` entries that let a job's gateway reach both indexes: plain
        HTTP, reads only."""
        return [{"host": i.alias, "port": i.port, "methods": ["GET", "HEAD"]} for i in (self.pypi, self.npm)]

    def logs(self, alias: str) -> str:
        """The index's log so far (pypiserver and verdaccio log every request): which packages
        a setup fetched."""
        container = self.docker.containers.get(self.index(alias).container)
        return container.logs().decode(errors="replace")

    def logged(self, alias: str, *texts: str, timeout: float = 10.0) -> str:
        """The index's log once it holds every one of `texts`, or as it is at `timeout` seconds:
        verdaccio writes a request's line after it answers, so a client can finish first."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.logs(alias)
            if all(t in log for t in texts) or time.monotonic() > deadline:
                return log
            time.sleep(0.1)

    def index(self, alias: str) -> Index:
        return {PYPI: self.pypi, NPM: self.npm}[alias]

    def run(
        self,
        command: str,
        *,
        network: str | None = None,
        image: str | None = None,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        **extra: Any,
    ) -> RunResult:
        """`sh -c command` in a hardened fila/testenv container (or `image`) on `network` (default:
        the indexes' network), with a 256 MiB executable home for a venv or node_modules."""
        return run_container(
            self.docker,
            ["sh", "-c", command],
            network=network or self.network,
            session=self.session,
            timeout=timeout,
            image=image or self.testenv_image,
            environment=env or {},
            **(CLIENT | extra),
        )


def ensure_built(client: docker.DockerClient, name: str) -> ImageRef:
    """A support image, built when missing or stale (reused by content hash and CA), trusting
    this host's system bundle as the build's extra CA: pip and npm reach their registries through
    this host's TLS-intercepting proxy at build (harmless where there is none)."""
    return build(
        name,
        DockerBackend(client),
        ca_file=SYSTEM_CA if SYSTEM_CA.exists() else None,
        progress=lambda _: None,
    )


def _name(session: str, alias: str) -> str:
    return f"fila-test-up-{session}-{alias.replace('.', '-')}"


def _start(
    client: docker.DockerClient, network: str, session: str, image: str, alias: str, **run: Any
) -> Index:
    name = _name(session, alias)
    labels = {LABEL: LABEL_VALUE, f"{LABEL}.session": session, f"{LABEL}.server": alias}
    c = client.containers.run(
        image,
        run.pop("command", [SERVICE.get(alias, "")]),
        name=name,
        detach=True,
        network=network,
        networking_config={network: client.api.create_endpoint_config(aliases=[alias])},
        **(HARDENED | {"labels": labels, "mem_limit": "512m"} | run),
    )
    url = f"http://127.0.0.1:{PORTS[alias]}{READY_PATH[alias]}"
    code, out = c.exec_run(["python3", "-c", _READY, url, str(READY_TIMEOUT_S)], user="65534:65534")
    c.reload()
    if code != 0 or c.status != "running":
        logs = c.logs().decode(errors="replace")[-1500:]
        raise RuntimeError(
            f"test index {alias} did not become ready ({c.status}): {out.decode(errors='replace')}{logs}"
        )
    return Index(alias=alias, ip=c.attrs["NetworkSettings"]["Networks"][network]["IPAddress"],
                 port=PORTS[alias], container=name)  # fmt: skip


@contextlib.contextmanager
def start_pkgindex(client: docker.DockerClient, ups: Upstreams) -> Iterator[PkgIndex]:
    """Both indexes on the upstreams' network, removed at the end; usable outside pytest (bench/)
    with `tests.upstreams.start_upstreams`."""
    image = ensure_built(client, "pkgindex").tag
    testenv = ensure_built(client, "testenv").tag
    started: list[Index] = []
    try:
        for alias in (PYPI, NPM):
            started.append(_start(client, ups.network, ups.session, image, alias))
        yield PkgIndex(
            network=ups.network,
            subnet=ups.subnet,
            pypi=started[0],
            npm=started[1],
            session=ups.session,
            testenv_image=testenv,
            docker=client,
        )
    finally:
        for alias in (PYPI, NPM):
            with contextlib.suppress(NotFound, APIError):
                client.containers.get(_name(ups.session, alias)).remove(force=True)


# pypiserver serving pypi.test's wheels to one user: its `auther` hook checks HTTP Basic on every
# list and download (401 without, 403 with a wrong password). Its htpasswd option needs passlib,
# which the image does not hold; the hook is the same check, in pypiserver's own request path.
_PRIVATE_SERVER = """
import os
import pypiserver
from pypiserver import bottle_wrapper as bottle
user, password = os.environ["INDEX_USER"], os.environ["INDEX_PASSWORD"]
app = pypiserver.app(roots=["/srv/pypi/packages"], authenticate=["download", "list", "update"],
                     password_file=None, auther=lambda u, p: u == user and p == password,
                     disable_fallback=True)
bottle.run(app=app, host="0.0.0.0", port=8080, server="auto", quiet=False)
"""


@contextlib.contextmanager
def private_pypi(idx: PkgIndex, user: str, password: str) -> Iterator[Index]:
    """A private registry for a setup route: `private.test:8080` on the indexes' network, a
    pypiserver of the fila/pkgindex image (pypi.test's wheels) that answers only `user` with
    `password` (HTTP Basic). Removed at the end."""
    image = ensure_built(idx.docker, "pkgindex").tag
    try:
        yield _start(
            idx.docker, idx.network, idx.session, image, PRIVATE,
            entrypoint=["/opt/pypiserver/bin/python", "-c", _PRIVATE_SERVER], command=[],
            environment={"INDEX_USER": user, "INDEX_PASSWORD": password, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        with contextlib.suppress(NotFound, APIError):
            idx.docker.containers.get(_name(idx.session, PRIVATE)).remove(force=True)
