"""Shared fixtures. Docker tests use the real daemon: a fake that always succeeds proves nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from hypothesis import settings

from fila.core.errors import EngineUnavailable
from fila.core.layout import Root
from fila.core.models import ImageRef
from fila.sandbox.docker.backend import DockerBackend
from fila.sandbox.docker.backend import docker_client as connect
from fila.sandbox.images import ensure_image
from tests.support.containers import Starts
from tests.support.engines import E2E_ENGINES, engine_policy
from tests.support.project import make_project, make_root
from tests.upstreams.fixtures import Upstreams, upstreams  # noqa: F401  (the `upstreams` fixture, for every test)

# The property tests draw the same examples every run (derandomize): the suite never fails on a
# draw it did not make before. FILA_HYPOTHESIS=explore draws new ones (`--hypothesis-seed=N`
# replays one); what a draw finds is kept as an @example of its test.
settings.register_profile("fila", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile("explore" if os.environ.get("FILA_HYPOTHESIS") == "explore" else "fila")

# scripts/test runs a tier in two processes side by side: FILA_TEST_PART=main keeps the tests of
# Docker, =side the rest (no container, rootless Podman's own service, PostgreSQL's own cluster)
# and the gateway's own tests (test_gateway: ~40 gateways, each its own network, nothing timed) and
# the upstreams' (test_upstreams: the test servers' own network, ~30 s), which bring the two
# processes nearer in length. In the quick tier, where Docker's tests are few
# (about 70 s of ~280 s), the tests that need no container and are in none of SIDE_FILES run in the
# main process instead (about 110 s), so neither process waits on the other.
SIDE_FILES = ("test_podman", "test_pg_", "test_queue_acceptance", "test_gateway", "test_upstreams")


def _on_the_side(item: pytest.Item, quick: bool) -> bool:
    # Every test that runs as the rootless-Podman test user is on one side: two processes sharing
    # that user and its runtime directory once removed one build's containers.conf under another.
    if item.path.name.startswith(SIDE_FILES) or item.get_closest_marker("podman_user") is not None:
        return True
    return item.get_closest_marker("docker") is None and not quick


_PART = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    # Taken out of the environment: a pytest a test starts (the Podman user's run, a collection it
    # counts) selects its own tests, whatever part this process runs.
    config.stash[_PART] = os.environ.pop("FILA_TEST_PART", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.stash.get(_PART, None)
    if part not in ("main", "side"):
        return
    quick = "quick" in (config.option.markexpr or "")  # scripts/test --quick: -m "quick or not docker"
    here = [_on_the_side(i, quick) == (part == "side") for i in items]
    config.hook.pytest_deselected(items=[i for i, h in zip(items, here, strict=True) if not h])
    items[:] = [i for i, h in zip(items, here, strict=True) if h]


@pytest.fixture
def root(tmp_path: Path) -> Root:
    """A queue root at tmp_path with the project the shell tasks target (greeting.txt), no daemon."""
    return make_project(tmp_path).require()


@pytest.fixture
def proj(root: Root, shell_image: ImageRef) -> Root:
    """The same queue root, for a test that runs the shell engine in a real container."""
    return root


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    # Fail, not skip: a machine without Docker must not pass the sandbox tests silently.
    try:
        return connect()
    except EngineUnavailable as e:
        pytest.fail(f"{e}\nhint: {e.hint}")


@pytest.fixture(scope="session")
def shell_image(docker_client: docker.DockerClient) -> ImageRef:
    return ensure_image("shell", DockerBackend(docker_client))


@pytest.fixture(scope="session")
def gateway_image(docker_client: docker.DockerClient) -> str:
    """The egress gateway's image, built when missing or stale (reused by content hash), so the
    tests that need it work on a fresh machine whatever order they run in. pip reaches PyPI through
    this host's TLS-intercepting proxy: the system bundle goes in as the build's extra CA (harmless
    where there is no such proxy)."""
    from fila.sandbox.images import GATEWAY_IMAGE, build

    system_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    build(
        "gateway",
        DockerBackend(docker_client),
        ca_file=system_ca if system_ca.exists() else None,
        progress=lambda _: None,
    )
    return GATEWAY_IMAGE


@pytest.fixture(scope="session")
def pkgindex(docker_client: docker.DockerClient, upstreams: Upstreams) -> Iterator[Any]:  # noqa: F811
    """pypi.test and npm.test: local package indexes on the upstreams' sealed network, with the
    fila/testenv image built (tests/support/pkgindex.py)."""
    from tests.support.pkgindex import start_pkgindex

    with start_pkgindex(docker_client, upstreams) as idx:
        yield idx


@pytest.fixture
def started_containers(docker_client: docker.DockerClient, proj: Any) -> Iterator[Any]:
    """Counts the containers the daemon starts for the test's queue root (`proj`), from Docker's
    live event stream."""
    s = Starts(docker_client, proj)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def engine_root(
    tmp_path: Path,
    upstreams: Upstreams,  # noqa: F811
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> Path:
    """A queue root with a.txt and, per engine, the policy that routes its CLI to the scripted
    model server (tests/upstreams) through the egress gateway."""
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    for engine, spec in E2E_ENGINES.items():
        engine_policy(tmp_path, upstreams, engine, spec.route)
    return tmp_path


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster on a unix socket (tests/support/pg.py), for the session."""
    from tests.support.pg import cluster

    with cluster() as c:
        yield c


@pytest.fixture
def pg_url(pg_cluster: Any) -> str:
    """A fresh database of the session's cluster, migrated to the schema this fila knows."""
    from fila.queue.pg import migrate

    url = pg_cluster.new_database()
    migrate.migrate(url)
    return url


@pytest.fixture
def q(pg_url: str) -> Iterator[Any]:
    """The PostgreSQL queue (queue/pg/store.PgQueue) on that database."""
    from fila.queue.pg.store import PgQueue

    with PgQueue(pg_url, reconnect_s=20) as queue:
        yield queue
