"""`network: allowlist` on rootless Podman, as an unprivileged user these tests create.

As root, `test_allowlist_passes_on_rootless_podman_as_an_ordinary_user` makes a throwaway user (no
docker group), loads Docker's fila/gateway and fila/testnet into that user's Podman storage
(`docker save | podman load`: the gateway's build needs PyPI, a rootless build has no network) and
runs this module's `as_user` tests as that user with FILA_CONTRACT_BACKEND=podman.

As the user, the upstreams are the test servers of tests/upstreams (model.test, allowed.test,
denied.test) in rootless Podman containers on the test's own `--internal` Podman network, which the
policy names as its egress network: no packet leaves this machine. Each blocked request is shown
next to its allowed counterpart succeeding in the same job, as tests/test_egress.py does on Docker.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fila.core.models import Policy
from fila.egress.config import Gateway
from fila.sandbox.base import RunSpec
from fila.sandbox.docker import backend as dk
from fila.sandbox.podman.backend import libpod_spec
from fila.sandbox.podman.egress import gateway_spec, job_network_spec
from fila.workspace.strategy import CopyWorkspace
from tests.support.policy import write_policy

AS_USER = os.environ.get("FILA_CONTRACT_BACKEND") == "podman" and os.getuid() != 0
as_user = pytest.mark.skipif(not AS_USER, reason="runs as the Podman test user (the root test starts it)")

KEY_VAR = "FILA_TEST_ANTHROPIC_KEY"
WAIVE = ["memory", "pids", "cpus"]  # rootless Podman on cgroup v1 (this machine) enforces none
MESSAGES = (
    '-H "content-type: application/json" -H "anthropic-version: 2023-06-01" '
    '-d \'{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}\''
)


# -- the pure mapping ------------------------------------------------------------------------------


def _spec(tmp_path: Path) -> RunSpec:
    job = tmp_path / "job"
    (job / "input").mkdir(parents=True, exist_ok=True)
    (job / "work").mkdir(exist_ok=True)
    policy = Policy.model_validate(
        {
            "network": "allowlist",
            "egress": {"allow": [{"host": "allowed.test", "port": 443}]},
            "waive": WAIVE,
            "max_timeout_ms": 60_000,
            "default_timeout_ms": 10_000,
        }
    )
    return RunSpec(
        job_id="t1",
        workspace=CopyWorkspace(job),
        image="fila/testnet:latest",
        argv=["sh", "-c", "true"],
        env={},
        policy=policy,
        limits=None,
        timeout_ms=1000,
        log_path=tmp_path / "log",
        labels={"fila.root": "/q"},
    )


def test_an_allowlist_engine_is_on_the_job_network_only_with_the_gateway_as_resolver(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    gw = Gateway("t1", "fila-net-t1-abcd", "fila-gw-t1-abcd", "10.89.3.2", tmp_path / "eg", ["anthropic"])
    body = libpod_spec(dk.create_kwargs(spec, "fila-t1-x", gw), rootless=True)
    assert body["netns"] == {"nsmode": "bridge"} and body["Networks"] == {"fila-net-t1-abcd": {}}
    assert body["dns_server"] == ["10.89.3.2"]
    assert body["sysctl"] == {"net.ipv6.conf.all.disable_ipv6": "1"}
    assert body["env"]["HTTPS_PROXY"] == "http://10.89.3.2:3128"
    assert body["env"]["ANTHROPIC_API_KEY"] == "fila-placeholder"
    # Without a gateway (the counterpart): no network at all, and any other network is refused.
    assert libpod_spec(dk.create_kwargs(spec, "fila-t1-x"), rootless=True)["netns"] == {"nsmode": "none"}
    kw = dk.create_kwargs(spec, "fila-t1-x", gw)
    with pytest.raises(ValueError, match="not mapped"):
        libpod_spec({**kw, "network_mode": "podman"}, rootless=True)


def test_the_gateway_and_job_network_request_keep_dockers_guarantees(tmp_path: Path) -> None:
    net = job_network_spec("fila-net-t1-abcd", {"fila": "1"})
    assert net["internal"] is True and net["dns_enabled"] is False and net["ipv6_enabled"] is False
    common = dict(name="gw", job_net="fila-net-t1-abcd", egress_net="fila-egress", state=tmp_path,
                  labels={"fila.root": "/q", "fila.job": "t1"}, uid=1000, gid=1000,
                  rootless=True)  # fmt: skip
    full = gateway_spec(**common)
    assert full["Networks"] == {"fila-net-t1-abcd": {}, "fila-egress": {}}
    assert full["sysctl"]["net.ipv4.ip_forward"] == "0"
    assert full["read_only_filesystem"] and full["cap_drop"] == ["ALL"] and full["no_new_privileges"]
    assert full["userns"] == {"nsmode": "keep-id"} and full["user"] == "1000:1000"
    assert full["labels"]["fila.role"] == "gateway" and full["labels"]["fila.job"] == "t1"
    assert set(full["resource_limits"]) == {"memory", "pids"}
    # Its config (and upstream CA) directory read-only; it loads the config once it is written.
    conf = [m for m in full["mounts"] if m["destination"] == "/etc/fila-gateway"]
    assert conf and conf[0]["source"] == str(tmp_path / "conf") and "ro" in conf[0]["options"], conf
    assert full["env"]["FILA_GATEWAY_WAIT"] == "1"
    # The gateway's limits are left out only where the job's policy waived the same ones.
    part = gateway_spec(**common, waive=frozenset({"memory"}))
    assert set(part["resource_limits"]) == {"pids"}


# -- the upstreams, in the user's rootless Podman --------------------------------------------------


@dataclass
class PodmanUpstreams:
    network: str
    subnet: str
    ca_file: Path
    ips: dict[str, str]
    log_dirs: dict[str, Path]
    script_file: Path

    def requests(self, alias: str) -> list[dict[str, Any]]:
        log = self.log_dirs[alias] / "requests.jsonl"
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []

    def set_script(self, steps: list[dict[str, Any]]) -> None:
        tmp = self.script_file.with_name(".script.tmp")
        tmp.write_text(json.dumps({"steps": steps, "written": secrets.token_hex(8)}))
        os.replace(tmp, self.script_file)


def _libpod(c: Any, method: str, path: str, body: Any = None, **params: Any) -> Any:
    from fila.sandbox.podman.egress import _call

    return _call(c, method, path, body, **params)


@pytest.fixture(scope="module")
def podman_upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanUpstreams]:
    from fila.sandbox.podman.backend import PodmanBackend
    from tests.upstreams.ca import make_ca
    from tests.upstreams.fixtures import SERVER_PY

    base = tmp_path_factory.mktemp("pm-upstreams")
    ca = make_ca(base / "ca")
    session = secrets.token_hex(4)
    net_name = f"fila-test-upstreams-{session}"
    labels = {"fila.test": "upstreams", "fila.test.session": session}
    backend = PodmanBackend()
    (base / "script").mkdir()
    script = base / "script" / "script.json"
    script.write_text('{"steps": []}')
    names: list[str] = []
    with backend.client() as c:
        # Internal: the servers reach nothing outside their subnet; DNS on, for their aliases.
        net = _libpod(c, "POST", "/libpod/networks/create",
                      {"name": net_name, "driver": "bridge", "internal": True, "dns_enabled": True,
                       "labels": labels})  # fmt: skip
        subnet = net["subnets"][0]["subnet"]
        try:
            ips, logs = {}, {}
            for alias, mode in (
                ("model.test", "model"),
                ("allowed.test", "static"),
                ("denied.test", "static"),
            ):
                cert = ca.issue(alias)
                logs[alias] = base / f"log-{alias}"
                logs[alias].mkdir()
                cmd = ["python3", "/srv/modelserver.py", "--mode", mode, "--name", alias, "--log-dir", "/log",
                       "--http-port", "80", "--https-port", "443", "--cert", "/certs/server.crt",
                       "--key", "/certs/server.key"]  # fmt: skip
                binds = {str(SERVER_PY): "/srv/modelserver.py", str(cert.cert): "/certs/server.crt",
                         str(cert.key): "/certs/server.key"}  # fmt: skip
                mounts = [{"destination": d, "source": s, "type": "bind", "options": ["rbind", "ro"]}
                          for s, d in binds.items()]  # fmt: skip
                mounts.append({"destination": "/log", "source": str(logs[alias]), "type": "bind",
                               "options": ["rbind", "rw"]})  # fmt: skip
                if mode == "model":
                    cmd += ["--script", "/script/script.json"]
                    mounts.append({"destination": "/script", "source": str(script.parent), "type": "bind",
                                   "options": ["rbind", "ro"]})  # fmt: skip
                name = f"fila-test-up-{session}-{alias.replace('.', '-')}"
                _libpod(c, "POST", "/libpod/containers/create", {
                    "image": "fila/testnet:latest", "name": name, "command": cmd, "labels": labels,
                    "mounts": mounts, "user": f"{os.getuid()}:{os.getgid()}", "userns": {"nsmode": "keep-id"},
                    "read_only_filesystem": True, "cap_drop": ["ALL"], "no_new_privileges": True,
                    "netns": {"nsmode": "bridge"}, "Networks": {net_name: {"aliases": [alias]}},
                    "sysctl": {"net.ipv4.ip_unprivileged_port_start": "0"},
                })  # fmt: skip
                names.append(name)
                c.api.start(name)
            deadline = time.monotonic() + 30
            for alias, d in logs.items():
                while not (d / "ready").exists():
                    assert time.monotonic() < deadline, f"{alias} did not start: {c.api.logs(names[-1])!r}"
                    time.sleep(0.05)
            for name, alias in zip(names, logs, strict=True):
                nets = c.api.inspect_container(name)["NetworkSettings"]["Networks"]
                ips[alias] = nets[net_name]["IPAddress"]
            yield PodmanUpstreams(net_name, subnet, ca.cert, ips, logs, script)
        finally:
            for name in names:
                with contextlib.suppress(Exception):  # timeout 0: killed at once, not after 10 s
                    _libpod(c, "DELETE", f"/libpod/containers/{name}", force="true", timeout="0")
            with contextlib.suppress(Exception):
                _libpod(c, "DELETE", f"/libpod/networks/{net_name}", force="true")


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, list(args), env=env)
    return res.exit_code, res.output


@pytest.fixture
def proj(tmp_path: Path, podman_upstreams: PodmanUpstreams) -> Path:
    q = tmp_path / "q"
    q.mkdir()
    assert _cli("init", "--root", str(q), "--backend", "podman")[0] == 0
    (q / "greeting.txt").write_text("hello\n")
    shutil.copyfile(podman_upstreams.ca_file, q / "ca.crt")  # the engine's TLS is end to end
    (q / "knock.py").write_text(KNOCK)
    return q


def _policy(q: Path, ups: PodmanUpstreams, **egress: Any) -> None:
    doc = {
        "network": "allowlist",
        "max_timeout_ms": 120_000,
        "default_timeout_ms": 60_000,
        "grace_ms": 1000,
        "waive": WAIVE,
        "egress": {
            "allow": [{"host": "allowed.test", "port": 443}],
            "egress_network": ups.network,
            "allow_private": [ups.subnet],
            "routes": {
                "anthropic": {
                    "upstream": "https://model.test",
                    "credential": KEY_VAR,
                    "ca_file": str(ups.ca_file),
                }
            },
        }
        | egress,
    }
    write_policy(q, "allow", doc)


def _submit(q: Path, command: str, env: dict[str, str]) -> str:
    targets = ["greeting.txt", "ca.crt", "knock.py"]
    task = {"engine": "shell", "command": command, "targets": targets, "policy": "allow",
            "image": "fila/testnet:latest"}  # fmt: skip
    (q / "task.json").write_text(json.dumps(task))
    code, out = _cli("submit", str(q / "task.json"), "--root", str(q), env=env)
    assert code == 0, out
    return out.strip()


def _leftovers(q: Path, tid: str) -> list[str]:
    from fila.sandbox.podman.backend import PodmanBackend

    out = []
    with PodmanBackend().client() as c:
        # The job's own, and a spare gateway the job took (or its worker kept), by their labels.
        for labels in ([f"fila.job={tid}"], ["fila.spare", f"fila.root={q}"]):
            out += [f"container {x['Names']}" for x in c.api.containers(all=True, filters={"label": labels})]
            flt = json.dumps({"label": labels})
            out += [
                f"network {n['name']}" for n in _libpod(c, "GET", "/libpod/networks/json", filters=flt) or []
            ]
    spares = q / "sandbox" / "spares"
    if (q / "sandbox" / "meta" / tid / "egress").exists() or (spares.is_dir() and any(spares.iterdir())):
        out.append("the gateway directory")
    return out


class Inspector(threading.Thread):
    """`inspect` of the job's engine and gateway containers (and its network) while they run."""

    def __init__(self, q: Path) -> None:
        super().__init__(daemon=True)
        self.q = q
        self.seen: dict[str, dict[str, Any]] = {}
        self.networks: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.netns_addrs = ""  # `ip -4 -o addr` of the user's rootless network namespace

    def run(self) -> None:
        from fila.sandbox.podman.backend import PodmanBackend

        with PodmanBackend().client() as c:
            while not self.stop.is_set():
                for x in c.api.containers(filters={"label": f"fila.root={self.q}"}):
                    role = (x.get("Labels") or {}).get("fila.role", "engine")
                    if role not in self.seen:
                        self.seen[role] = c.api.inspect_container(x["Id"])
                flt = json.dumps({"label": [f"fila.root={self.q}", "fila.role=job-net"]})
                for n in _libpod(c, "GET", "/libpod/networks/json", filters=flt) or []:
                    self.networks.setdefault(n["name"], n)
                if self.networks and " inet " not in self.netns_addrs:  # again until it answers
                    ns = ["podman", "unshare", "--rootless-netns", "ip", "-4", "-o", "addr"]
                    self.netns_addrs = subprocess.run(ns, capture_output=True, text=True).stdout
                time.sleep(0.1)


# What the engine runs: each blocked path beside its allowed counterpart. `knock` connects to the
# job network's own bridge address (Podman gives it one in the rootless namespace) and to the
# gateway's proxy port: the proxy must answer, nothing on the bridge may.
KNOCK = (
    "import socket,sys\n"
    "for h,p in [a.rsplit(':',1) for a in sys.argv[1:]]:\n"
    "    s=socket.socket(); s.settimeout(3)\n"
    "    try: s.connect((h,int(p))); r='connected'\n"
    "    except OSError as e: r=type(e).__name__\n"
    "    print(f'knock {h}:{p}: {r}')\n"
)


@as_user
def test_on_podman_the_engine_reaches_the_listed_host_and_route_never_an_unlisted_host_nor_the_key(
    proj: Path, podman_upstreams: PodmanUpstreams
) -> None:
    """The job's egress on rootless Podman; then (its refused counterpart, after this allowed job
    on the test's own network) a policy naming an egress network that does not exist."""
    ups = podman_upstreams
    secret = f"sk-test-{secrets.token_hex(16)}"
    env = {KEY_VAR: secret}
    os.environ[KEY_VAR] = secret  # the in-process CLI's worker reads the credential here
    _policy(proj, ups)
    cmd = (
        'echo "allowed: $(curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ 2>&1)"; '
        'echo "denied: $(curl -sS --max-time 10 --cacert ca.crt -o /dev/null -w "%{http_connect}" '
        'https://denied.test/ 2>/dev/null)"; '
        'echo "direct: $(curl -sS --noproxy "*" --connect-timeout 3 --max-time 5 -k '
        f'https://{ups.ips["allowed.test"]}/ 2>&1)"; '
        'echo "dns: $(getent hosts allowed.test || echo none)"; '
        'echo "ipv6 off: $(cat /proc/sys/net/ipv6/conf/all/disable_ipv6)"; '
        'gw=${HTTPS_PROXY#http://}; gw=${gw%:*}; echo "gateway: $gw"; '
        "python3 knock.py $gw:3128 $gw:22 $gw:80 10.0.2.2:80 10.0.2.3:53 10.0.2.100:80; "
        'echo "routes: $(ip -4 route | tr "\\n" ";")"; '
        f'echo "model: $(curl -sS --max-time 10 -X POST "$ANTHROPIC_BASE_URL/v1/messages" '
        f'-H "x-api-key: $ANTHROPIC_API_KEY" {MESSAGES})"; '
        "env | sort > env.txt; sleep 1"
    )
    tid = _submit(proj, cmd, env)
    usage = {"input_tokens": 7, "output_tokens": 3}
    ups.set_script([{"reply": {"text": "hello from the model"}, "usage": usage}])
    watch = Inspector(proj)
    watch.start()
    try:
        code, out = _cli("run", "--once", "--root", str(proj), env=env)
    finally:
        watch.stop.set()
        watch.join()
    assert code == 0, out
    rec = json.loads((proj / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "needs_review" and rec["backend"] == "podman", rec.get("error")
    log = (proj / rec["log_path"]).read_text()
    lines = dict(line.split(": ", 1) for line in log.splitlines() if ": " in line)
    # Allowed first: the listed host answers through the gateway's tunnel, TLS end to end.
    assert lines["allowed"] == "hello from allowed.test", log
    assert lines["denied"] == "403", log  # the unlisted host on the same server: CONNECT refused
    assert ups.requests("denied.test") == []
    # Around the gateway: no route to the very server that answered through it, no resolver.
    assert "hello from" not in lines["direct"], log
    assert lines["dns"] == "none" and lines["ipv6 off"] == "1", log
    assert lines["routes"].count(";") == 1 and "default" not in lines["routes"], log  # its subnet only
    # The gateway's proxy answers on the job network (the counterpart); nothing else there, nor
    # slirp4netns' host, DNS and tap addresses of the rootless namespace (no route there).
    knocks = {k.removeprefix("knock "): v for k, v in lines.items() if k.startswith("knock ")}
    assert len(knocks) == 6 and knocks.pop(f"{lines['gateway']}:3128") == "connected", log
    assert [k for k, v in knocks.items() if v == "connected"] == [], log
    # Like Docker's inhibit_ipv4: the job network's bridge holds no address in the rootless
    # namespace (an internal network with DNS off), so no service there is reachable through it.
    (net,) = watch.networks.values()
    subnet = ipaddress.ip_network(net["subnets"][0]["subnet"])
    assert "gateway" not in net["subnets"][0], net
    ns_addrs = [
        ipaddress.ip_interface(a.split()[3]).ip for a in watch.netns_addrs.splitlines() if " inet " in a
    ]
    assert ns_addrs and not [a for a in ns_addrs if a in subnet], watch.netns_addrs
    # The model route: the model server got the real key, which the engine never held.
    assert "hello from the model" in lines["model"], log
    got = ups.requests("model.test")
    assert len(got) == 1 and got[0]["headers"].get("x-api-key") == secret, got
    engine = watch.seen["engine"]
    assert list(engine["NetworkSettings"]["Networks"]) == list(watch.networks), engine["NetworkSettings"]
    assert "ANTHROPIC_API_KEY=fila-placeholder" in engine["Config"]["Env"]
    # The engine's work/: the job's own copy, or the upper layer of its overlay on a snapshot.
    works = [proj / "sandbox" / "jobs" / tid / "work", proj / "sandbox" / "meta" / tid / "overlay" / "upper"]
    env_txt = next(w / "env.txt" for w in works if (w / "env.txt").is_file()).read_text()
    assert "ANTHROPIC_BASE_URL=http://" in env_txt and "HTTPS_PROXY=http://" in env_txt
    code, html = _cli("review", tid, "--html", "--root", str(proj))
    code, show = _cli("show", tid, "--root", str(proj))
    everything = {
        "engine inspect": json.dumps(engine),
        "gateway inspect": json.dumps(watch.seen["gateway"]),
        "engine env": env_txt,
        "job dir": "".join(
            p.read_text(errors="replace")
            for d in (proj / "sandbox" / "jobs" / tid, proj / "sandbox" / "meta" / tid)
            for p in d.rglob("*")
            if p.is_file()
        ),
        "log": log,
        "record": (proj / "fila" / "out" / f"{tid}.json").read_text(),
        "REVIEW.html": Path(html.strip()).read_text(),
        "show": show,
    }
    assert [k for k, v in everything.items() if secret in v] == []
    # The job network: internal, no DNS server on it, labelled; the gateway on it and the egress one.
    assert net["internal"] is True and net["dns_enabled"] is False, net
    assert set(watch.seen["gateway"]["NetworkSettings"]["Networks"]) == {net["name"], ups.network}
    # The record's egress section: each decision, per-route usage read at the gateway.
    eg = rec["egress"]
    assert eg["allowed"] >= 2 and eg["denied"] >= 1, eg
    assert any(r["host"] == "denied.test" and not r["allowed"] and r["reason"] for r in eg["requests"]), eg
    assert eg["routes"]["anthropic"]["requests"] == 1
    assert (eg["routes"]["anthropic"]["input_tokens"], eg["routes"]["anthropic"]["output_tokens"]) == (7, 3)
    assert "route     anthropic: 1 requests" in show and "DENIED" in show, show
    # The engine's own lookup went to the gateway's DNS door only: refused and recorded.
    dns = [r for r in eg["requests"] if r["door"] == "dns"]
    assert dns and not [r for r in dns if r["allowed"]], eg["requests"]
    assert any("allowed.test" in (r["host"] or "") for r in dns), dns
    # Nothing of the job is left: no gateway, no network, no secrets directory.
    assert _leftovers(proj, tid) == []
    # The same job under a policy whose egress network does not exist: refused, the field named,
    # before any container.
    missing = f"fila-test-missing-{secrets.token_hex(4)}"
    _policy(proj, ups, egress_network=missing)
    tid = _submit(proj, cmd, env)
    _cli("run", "--once", "--root", str(proj), env=env)
    rec = json.loads((proj / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec["error"]
    assert "'egress.egress_network'" in rec["error"]["message"] and missing in rec["error"]["message"]
    assert not rec["container_started"] and _leftovers(proj, tid) == []


@as_user
@pytest.mark.matrix  # Docker's twin (tests/test_egress.py) is the default run's: scripts/test --all
def test_on_podman_a_killed_worker_leaves_its_gateway_and_network_and_recover_removes_them(
    proj: Path, podman_upstreams: PodmanUpstreams
) -> None:
    env = {KEY_VAR: f"sk-test-{secrets.token_hex(8)}"}
    _policy(proj, podman_upstreams)
    tid = _submit(
        proj, "curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ > got.txt; sleep 30", env
    )
    run_env = {**os.environ, **env, "FILA_ROOT": str(proj), "FILA_CRASH_AT": "during_run"}
    res = subprocess.run([sys.executable, "-c", "from fila.cli import main; main()", "run", "--once"],
                         env=run_env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == -9, res.stdout + res.stderr  # SIGKILLed with its containers running
    left = _leftovers(proj, tid)
    # The counterpart: the crash left the engine, the gateway (the spare the job took), the job
    # network and the secrets.
    assert sum(x.startswith("container") for x in left) == 2, left
    assert sum(x.startswith("network") for x in left) == 1 and "the gateway directory" in left, left
    code, out = _cli("recover", "--root", str(proj))
    assert code == 0, out
    assert _leftovers(proj, tid) == [], out
    rec = json.loads((proj / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "needs_human" and rec["container_started"], rec  # never run twice


# -- the driver (root) -----------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.skipif(os.getuid() != 0, reason="creating an ordinary user for the test needs root")
@pytest.mark.skipif(shutil.which("podman") is None, reason="scripts/podman-up installs podman")
def test_allowlist_passes_on_rootless_podman_as_an_ordinary_user(
    docker_client: Any, gateway_image: str, request: pytest.FixtureRequest
) -> None:
    import pwd
    import re

    from fila.egress import config as egress
    from fila.sandbox.docker.backend import DockerBackend
    from fila.sandbox.images import ensure_image
    from tests.support.users import (
        podman_user,
        pytest_as_user,
        python_for_others,
        readable_tests_dir,
        selected_as_user,
    )

    python = python_for_others()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} an ordinary user may run")
    ensure_image("testnet", DockerBackend(docker_client), progress=lambda _l: None)
    here = readable_tests_dir()
    with podman_user() as user:
        home = pwd.getpwnam(user).pw_dir
        # The cheapest honest way into the user's storage: the very images Docker built (their
        # labels carry the build inputs), without a second build.
        save = subprocess.Popen(["docker", "save", egress.GATEWAY_IMAGE, "fila/testnet:latest"],
                                stdout=subprocess.PIPE)  # fmt: skip
        load = subprocess.run(["runuser", "-u", user, "--", "env", f"HOME={home}", "podman", "load"],
                              stdin=save.stdout, capture_output=True, text=True, cwd=home,
                              timeout=300)  # fmt: skip
        assert save.wait() == 0 and load.returncode == 0, load.stderr
        files, markexpr = ["test_podman_egress.py"], request.config.option.markexpr
        out = pytest_as_user(user, python, here, files, timeout=900, markexpr=markexpr)
    m = re.search(r"(\d+) passed", out)
    selected = selected_as_user(here, files, markexpr)
    assert m is not None and int(m.group(1)) == selected >= 3 and "skipped" not in out, out[-3000:]
