"""`fila doctor` on the real host: every check passes here, and a broken policy fails it by name."""

from __future__ import annotations

import json
from pathlib import Path

import docker
import pytest

from fila.core.models import ImageRef
from tests.support.cli import fila
from tests.support.project import make_root

pytestmark = pytest.mark.docker


@pytest.fixture
def root(tmp_path: Path, shell_image: ImageRef, gateway_image: str) -> Path:
    make_root(tmp_path)
    return tmp_path


def test_doctor_passes_every_check_and_the_self_test_proves_the_sandbox(
    root: Path, docker_client: docker.DockerClient
) -> None:
    res = fila(root, "doctor", "--json")
    rep = json.loads(res.stdout)
    assert res.exit_code == 0 and rep["ok"], res.output
    checks = {c["name"]: c for c in rep["checks"]}
    assert set(checks) >= {"engine", "runtimes", "images", "policies", "no network", "input read-only",
                           "no capabilities", "allowlist"}  # fmt: skip
    assert checks["no network"]["detail"].endswith(": lo")
    assert checks["no capabilities"]["detail"] == "CapEff 0000000000000000"
    # The listed host answered with the upstream's own token; the unlisted one was refused.
    assert "allowed.test -> 200 (the upstream's token)" in checks["allowlist"]["detail"]
    assert "denied.test -> 403" in checks["allowlist"]["detail"]
    assert rep["seconds"] < 30  # a loose bound: the self-test is meant to take ~5-10 s
    # Nothing of the self-test is left behind.
    assert docker_client.containers.list(all=True, filters={"label": "fila.role=doctor"}) == []
    assert docker_client.networks.list(filters={"label": "fila.role=doctor"}) == []


def test_doctor_fails_naming_an_invalid_policy(root: Path) -> None:
    ok = fila(root, "doctor", "--no-self-test")
    assert ok.exit_code == 0, ok.output
    (root / "policies" / "broken.json").write_text(
        json.dumps(
            {
                "network": "allowlist",
                "max_timeout_ms": 1000,
                "default_timeout_ms": 1000,
                "egress": {"allow": [{"host": "169.254.169.254"}]},
            }
        )
    )
    res = fila(root, "doctor", "--no-self-test")
    assert res.exit_code == 1, res.output
    assert "FAIL  policies" in res.output and "broken: policy field 'egress.allow.0.host'" in res.output
    assert "failed checks: policies" in res.output
