"""Setup routes without containers (docs/environments.md, "Secrets for the setup"): what a policy
may declare, the key (routes in, credentials out), the credential read on the host and refused
naming its variable or file, the setup's own policy, and the path rules the gateway applies. The
end-to-end case, a private index through the route, is tests/test_env_run.py's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fila.core.errors import InvalidPolicy
from fila.core.models import Policy, Route, SetupPolicy
from fila.egress import config as egress
from fila.env import key as keys
from fila.env.build import route_vars, setup_credentials, setup_policy
from fila.env.spec import EnvSpec, Step
from fila.queue.policy import validate_document
from fila.workspace import secretscan

TOKEN = "corp-token-0123456789abcdef"
GATEWAY_DIR = Path(__file__).resolve().parents[1] / "images" / "gateway"


def _policy(routes: dict[str, Any], **setup: Any) -> dict[str, Any]:
    return {
        "max_timeout_ms": 60_000,
        "default_timeout_ms": 60_000,
        "environment": {"routes": routes, **setup},
    }


def _refused(doc: dict[str, Any]) -> str:
    with pytest.raises(InvalidPolicy) as e:
        validate_document("policy", doc)
        egress.validate(Policy.model_validate(doc))
    return e.value.message


CORP = {"upstream": "https://pypi.corp.example/", "credential": "CORP_TOKEN"}


def test_a_setup_route_is_declared_with_its_upstream_and_a_credential_and_refused_otherwise() -> None:
    repo = "https://corp.jfrog.io/artifactory/api/pypi/pypi-local"
    good = _policy({"corp": CORP | {"upstream": repo, "paths": ["GET /**"], "format": "Basic {key}"}})
    validate_document("policy", good)
    egress.validate(Policy.model_validate(good))
    cases = {
        "no upstream": ({"corp": {"credential": "CORP_TOKEN"}}, "needs its upstream"),
        "an engine route's name": ({"anthropic": CORP}, "engine route's name"),
        "a name that is no shell name": ({"Corp-1": CORP}, "Corp-1"),
        "no credential": ({"corp": {"upstream": CORP["upstream"]}}, "exactly one of credential"),
        "both credentials": ({"corp": CORP | {"credential_file": "/x"}}, "exactly one of credential"),
        "an address": ({"corp": CORP | {"upstream": "http://10.0.0.5:8080"}}, "IP address"),
        "a private name": ({"corp": CORP | {"upstream": "http://index.internal"}}, "private name"),
        "** inside a rule": ({"corp": CORP | {"paths": ["GET /**/simple"]}}, "whole last segment"),
        "a dot segment": ({"corp": CORP | {"paths": ["GET /a/../**"]}}, "dot segment"),
        "a format without {key}": ({"corp": CORP | {"format": "Basic"}}, "{key}"),
        "a dot segment upstream": ({"corp": CORP | {"upstream": "https://r.example/../x"}}, "dot segment"),
        "a query upstream": ({"corp": CORP | {"upstream": "https://r.example/a?x=1"}}, "upstream"),
    }
    for what, (routes, says) in cases.items():
        assert says in _refused(_policy(routes)), what
    # An engine's egress route keeps its own rules: known names only.
    doc = {"max_timeout_ms": 1000, "default_timeout_ms": 1000, "network": "allowlist",
           "egress": {"routes": {"corp": CORP}}}  # fmt: skip
    assert "unknown route 'corp'" in _refused(doc)


def _key(setup: SetupPolicy) -> str:
    spec = EnvSpec(image="fila/testenv:latest", setup=[Step(name="s", shell="pip install six")])
    return keys.compute(keys.content(spec, {"image_id": "sha256:abc"}, keys.Inputs({})), setup)


def test_the_key_names_what_a_route_sends_where_never_its_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotated token reuses the environment; another upstream, header, format or rule is
    another environment."""
    base = SetupPolicy(routes={"corp": Route(**CORP)})
    monkeypatch.setenv("CORP_TOKEN", "one-token-0123456789")
    first = _key(base)
    monkeypatch.setenv("CORP_TOKEN", "rotated-token-0123456789")
    assert _key(base) == first
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    by_file = Route(upstream=CORP["upstream"], credential_file=str(secret))
    assert _key(SetupPolicy(routes={"corp": by_file})) == first  # where the token lives: not the key
    for change in ({"upstream": "https://other.example"}, {"header": "x-token"}, {"format": "Basic {key}"},
                   {"paths": ["GET /simple/**"]}):  # fmt: skip
        assert _key(SetupPolicy(routes={"corp": Route(**CORP | change)})) != first, change
    assert _key(SetupPolicy(routes={"corp2": Route(**CORP)})) != first
    assert _key(SetupPolicy()) != first


def test_the_credential_is_read_on_the_host_and_a_missing_one_names_its_variable_or_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    secret.chmod(0o600)
    by_file = Route(upstream=CORP["upstream"], credential_file=str(secret))
    setup = SetupPolicy(routes={"corp": Route(**CORP), "files": by_file})
    monkeypatch.setenv("CORP_TOKEN", "env-" + TOKEN)
    assert setup_credentials(setup) == ["env-" + TOKEN, TOKEN]
    monkeypatch.delenv("CORP_TOKEN")
    with pytest.raises(InvalidPolicy, match=r"environment\.routes\.corp\.credential.*CORP_TOKEN is not set"):
        setup_credentials(setup)
    monkeypatch.setenv("CORP_TOKEN", TOKEN)
    secret.chmod(0o644)
    with pytest.raises(InvalidPolicy, match=r"environment\.routes\.files\.credential_file.*0644"):
        setup_credentials(setup)
    # The engine's runs know it too: should it ever reach a job, the log and the diff hide it.
    secret.chmod(0o600)
    policy = Policy.model_validate(_policy({"corp": CORP}))
    assert TOKEN in [c.value for c in secretscan.known(policy)]


def test_the_setups_policy_holds_its_routes_and_the_image_empties_their_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = Policy.model_validate(_policy({"corp": CORP}, allow=[]))
    assert policy.network == "none" and policy.egress is None  # the engine's: nothing of the route
    setup = setup_policy(policy, policy.environment)
    assert setup.network == "allowlist" and setup.egress is not None and list(setup.egress.routes) == ["corp"]
    assert route_vars(policy.environment) == ["FILA_ROUTE_CORP"]
    monkeypatch.setenv("CORP_TOKEN", TOKEN)
    (resolved,) = egress.resolve_routes(setup)
    shape = (resolved.upstream, resolved.header, resolved.format, resolved.paths, resolved.key)
    assert shape == (
        "https://pypi.corp.example",
        "authorization",
        "Bearer {key}",
        ["GET /**", "HEAD /**"],
        TOKEN,
    )
    gw = egress.Gateway("job", "net", "gw", "172.30.0.2", Path("/nonexistent"), ["corp"])
    assert gw.engine_env()["FILA_ROUTE_CORP"] == "http://172.30.0.2:8080/corp"
    # No routes and no hosts: the setup has no network at all, as before.
    bare = Policy.model_validate(_policy({}, allow=[]))
    assert setup_policy(bare, bare.environment).network == "none"


@pytest.fixture(scope="module")
def gwconfig() -> Iterator[ModuleType]:
    """The gateway's config module, imported from the image's source (no mitmproxy needed)."""
    sys.path.insert(0, str(GATEWAY_DIR))
    try:
        from fila_gw import config

        yield config
    finally:
        sys.path.remove(str(GATEWAY_DIR))
        for name in [m for m in sys.modules if m == "fila_gw" or m.startswith("fila_gw.")]:
            del sys.modules[name]


def test_a_last_double_star_matches_a_registrys_deep_paths_and_a_star_still_one_segment(
    gwconfig: ModuleType,
) -> None:
    rest = gwconfig.path_rule("/**")
    for path in ("/simple/six/", "/packages/ab/cd/six-1.17.0+local-py3-none-any.whl", "/@corp%2Fpkg",
                 "/@corp/pkg/-/pkg-1.0.0.tgz", "/"):  # fmt: skip
        assert rest.match(path), path
    for path in ("/a%2e%2e/b", "/a%20b", "/a;b", "/a\\b", "/a?b", ""):
        assert not rest.match(path), path
    under = gwconfig.path_rule("/simple/**")
    assert under.match("/simple/six/") and not under.match("/simple") and not under.match("/packages/x")
    one = gwconfig.path_rule("/v1/models/*")
    assert one.match("/v1/models/claude-3") and not one.match("/v1/models/a/b")
    assert not one.match("/v1/models/a%2Fb")  # an escaped slash is never one segment
    assert [gwconfig.path_rule_ok(p) for p in ("/**", "/a/**", "/**/a", "/a**", "/a/**/**", "/a/../**")] == [
        True, True, False, False, False, False]  # fmt: skip


def test_suggest_setup_keeps_a_route_out_of_the_allowlist_and_names_one_no_setup_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a setup reached through its route is the route's, never an allow entry; the learned
    host is (the allowed counterpart); a route no setup called is listed as unused. `fila doctor`
    says whether each route's credential can be read."""
    import hashlib

    from fila.core.models import (
        EgressRecord,
        EgressRequest,
        EnvironmentRecord,
        PolicyRef,
        Record,
        RouteSummary,
    )
    from fila.env.manage import route_credentials
    from fila.queue import policy as policies
    from tests.support.project import make_root

    routes = {"corp": CORP, "spare": CORP | {"credential": "SPARE_TOKEN"}}
    doc = _policy(routes, learn=True, max_requests=50)
    text = json_text(doc)
    root = make_root(tmp_path / "root")
    (root.policies_dir / "hand.json").write_text(text)
    reqs = [
        EgressRequest(door="proxy", method="CONNECT", host="pypi.org", port=443, allowed=True, learned=True),
        EgressRequest(
            door="route", method="GET", host="pypi.corp.example", port=443, route="corp", allowed=True
        ),
    ]
    egress_rec = EgressRecord(requests=reqs, routes={"corp": RouteSummary(requests=1)}, learning=True)
    env = EnvironmentRecord(key="k" * 64, source="fila-environment.json", form="fila", how="built",
                            egress=egress_rec)  # fmt: skip
    ref = PolicyRef(name="hand", sha256=hashlib.sha256(text.encode()).hexdigest())
    run = Record(id="t1", status="needs_review", policy=ref, environment=env)
    s = policies.suggest(root, [run], setup=True)
    assert s.allow == [{"host": "pypi.org", "port": 443}] and s.unused[-1] == "environment.routes.spare", s
    assert not any("corp" in u for u in s.unused)
    monkeypatch.setenv("CORP_TOKEN", TOKEN)
    monkeypatch.delenv("SPARE_TOKEN", raising=False)
    got = route_credentials(Policy.model_validate(doc))
    assert got["corp"] is None and "SPARE_TOKEN is not set" in (got["spare"] or ""), got


def json_text(doc: dict[str, Any]) -> str:
    import json

    return json.dumps(doc, indent=2) + "\n"


def test_recovery_removes_a_dead_setups_gateway_directory_and_never_a_live_ones(tmp_path: Path) -> None:
    """A setup killed while its gateway held a route's secret leaves its directory under the key's
    state: recovery removes it once no live setup holds the key's lock; a live one's is kept."""
    from fila.core import fsutil
    from fila.env.build import state_dir, sweep_setup_gateways
    from tests.support.project import make_root

    root = make_root(tmp_path / "root")
    dead, live = (state_dir(root, c * 64) for c in "ab")
    for state in (dead, live):
        (state / "egress" / "secrets").mkdir(parents=True)
        (state / "egress" / "secrets" / "corp").write_text(TOKEN)
    with fsutil.file_lock(live / ".lock"):
        assert sweep_setup_gateways(root) == [str(dead / "egress")]
    assert not (dead / "egress").exists() and (live / "egress" / "secrets" / "corp").exists()
    assert sweep_setup_gateways(root) == [str(live / "egress")]  # its setup is gone now


def test_a_basic_credentials_user_password_and_password_are_redacted_like_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `Basic {key}` route's token is the base64 of `user:password`: the setup's log is redacted
    of the decoded pair and of the password alone too, and a job's scanner knows both. A Bearer
    token is the counterpart: it has no decoded form."""
    import base64

    from fila.sandbox.docker.logs import redactor

    password = "index-password-41d7"
    token = base64.b64encode(f"corp:{password}".encode()).decode()
    monkeypatch.setenv("CORP_TOKEN", token)
    assert setup_credentials(SetupPolicy(routes={"corp": Route(**CORP)})) == [token]
    basic = SetupPolicy(routes={"corp": Route(**CORP, format="Basic {key}")})
    assert setup_credentials(basic) == [token, f"corp:{password}", password]
    log = f"pip: url http://corp:{password}@pypi.corp.example/ said {password} for user corp\n".encode()
    masker = redactor(setup_credentials(basic))
    masked = masker.feed(log) + masker.flush()
    assert password.encode() not in masked and b"for user corp" in masked, masked
    policy = Policy.model_validate(_policy({"corp": CORP | {"format": "Basic {key}"}}))
    assert {token, f"corp:{password}", password} <= {c.value for c in secretscan.known(policy)}


def test_a_hold_keeps_its_build_alive_for_recovery_and_its_directory_until_its_process_is_gone(
    tmp_path: Path,
) -> None:
    """`fila env build` runs no task: its hold's lock is what recovery sees alive (its job id's
    containers and networks are kept while it lives), and a hold's directory (a build gateway's
    state, a route's secret in it) is removed by the sweep once no process holds its lock, never
    while one does."""
    import subprocess

    from fila.env import hold
    from fila.recovery.sweep import _has_claim
    from tests.support.project import make_root

    root = make_root(tmp_path / "root")
    with hold.hold(root) as live:
        assert _has_claim(root, live.job_id, None)  # the allowed counterpart: kept while it lives
        (live.dir / "gateway" / "secrets").mkdir(parents=True)
        (live.dir / "gateway" / "secrets" / "corp").write_text(TOKEN)
        assert hold.sweep(root) == [] and (live.dir / "gateway" / "secrets" / "corp").exists()
    assert not live.dir.exists() and not _has_claim(root, live.job_id, None)  # its own end removed it
    assert not _has_claim(root, "env-build", None)  # no hold names a bare id
    # A process killed mid-build: its directory and lock stay on disk, free; the sweep takes them.
    code = (
        "import os, sys\nfrom pathlib import Path\n"
        "from fila.core.layout import Root\nfrom fila.env import hold\n"
        "with hold.hold(Root(Path(sys.argv[1]))) as h:\n"
        "    (h.dir / 'gateway').mkdir(); (h.dir / 'gateway' / 'corp').write_text(sys.argv[2])\n"
        "    print(h.job_id, flush=True); os._exit(9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(root.path), TOKEN], capture_output=True, text=True)
    assert out.returncode == 9, out.stderr
    job_id = out.stdout.strip()
    dead = hold.holds_dir(root) / job_id.removeprefix(hold.BUILD_PREFIX)
    assert (dead / "gateway" / "corp").read_text() == TOKEN
    assert not _has_claim(root, job_id, None)  # its containers are a dead job's now
    assert hold.sweep(root) == [str(dead)] and not dead.exists()
    assert list(hold.holds_dir(root).iterdir()) == []  # its lock went too
