"""The `upstreams` pytest fixture: real test servers on the test's own `--internal` network.

Session-scoped. It builds `fila/testnet` when needed (fila's own ensure_image), makes a test CA,
creates an internal network with no IPv4 on the host side (so nothing there reaches the host or
the internet), PROVES that from a probe container before any server starts, then starts the
scripted model server (`model.test`) and the static HTTPS servers (`allowed.test`,
`other.allowed.test`, `denied.test`) as hardened containers, and tears all of it down at the end.
See tests/upstreams/README.md for the API.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import APIError, NotFound

from fila.core.fsutil import pid_alive
from fila.sandbox.docker.backend import DockerBackend
from fila.sandbox.images import ensure_image

from .ca import TestCA, make_ca

IMAGE = "fila/testnet:latest"
LABEL = "fila.test"
LABEL_VALUE = "upstreams"
MODEL = "model.test"
STATIC = ("allowed.test", "other.allowed.test", "denied.test")
HTTP_PORTS = (80, 8080)
HTTPS_PORTS = (443, 8443)
BANNER_PORT = 2222  # static servers: a server that speaks first (modelserver.serve_banner)
CA_IN_CONTAINER = "/etc/fila-test/ca.crt"
SERVER_PY = Path(__file__).with_name("modelserver.py")
# Every network the tests create takes a /24 of this pool: outside Docker's default address pools
# (172.17.0.0/16-172.31.0.0/16, 192.168.0.0/16), so a daemon that has handed those out to its own
# networks (fila's job and egress networks among them) still has room here, and the tests' networks
# never take an address an auto-addressed network wants. Each is internal: no route out.
SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")
READY_TIMEOUT_S = 30.0
# Documentation addresses (never routed on the internet) a probe tries to connect to: the
# allowed counterpart is the test servers answering, checked by the tests.
OUTSIDE = ("192.0.2.1", "198.51.100.1")

# Hardening shared by every container this fixture starts (like an engine's sandbox).
HARDENED: dict[str, Any] = {
    "user": "65534:65534",
    "read_only": True,
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges"],
    "tmpfs": {"/tmp": "rw,nosuid,nodev,noexec,size=16m", "/home/fila": "rw,nosuid,nodev,size=4m,mode=1777"},
    "mem_limit": "256m",
    "pids_limit": 256,
    "init": True,
}


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None: still running at the timeout (then killed)
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Upstream:
    alias: str
    ip: str
    container: str
    log_dir: Path  # host directory holding requests.jsonl
    mode: str  # "model" or "static"


@dataclass
class Upstreams:
    """What the fixture yields: the network, the servers, the CA, and helpers."""

    network: str
    subnet: str
    ca: TestCA
    servers: dict[str, Upstream]
    script_file: Path
    session: str
    docker: docker.DockerClient = field(repr=False)
    image: str = IMAGE
    # What check_no_route_out saw from the network when the fixture made it (and proved it sealed).
    probe: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ca_file(self) -> Path:
        """Host path of the test CA certificate (PEM): what clients and the gateway trust."""
        return self.ca.cert

    def ip(self, alias: str) -> str:
        return self.servers[alias].ip

    def set_script(self, script: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Replace the model server's script (a list of steps, or {"steps": [...]}); every step
        is unused again. The server re-reads the file on its next request."""
        doc = {"steps": script} if isinstance(script, list) else dict(script)
        doc["written"] = uuid.uuid4().hex  # new content, so the server resets even for the same steps
        tmp = self.script_file.with_name(f".script-{uuid.uuid4().hex}.json")
        tmp.write_text(json.dumps(doc))
        tmp.chmod(0o644)
        os.replace(tmp, self.script_file)

    def requests(self, alias: str = MODEL) -> list[dict[str, Any]]:
        """Every request the server `alias` logged so far, oldest first."""
        log = self.servers[alias].log_dir / "requests.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def clear_requests(self, alias: str | None = None) -> None:
        for name in [alias] if alias else list(self.servers):
            (self.servers[name].log_dir / "requests.jsonl").unlink(missing_ok=True)

    def run(
        self,
        command: str,
        *,
        network: str | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        **extra: Any,
    ) -> RunResult:
        """`sh -c command` in a hardened fila/testnet container on `network` (default: the
        upstream network), with the test CA at /etc/fila-test/ca.crt (`curl --cacert ...`)."""
        return run_container(
            self.docker,
            ["sh", "-c", command],
            network=network or self.network,
            session=self.session,
            volumes={str(self.ca_file): {"bind": CA_IN_CONTAINER, "mode": "ro"}},
            environment=env or {},
            timeout=timeout,
            **extra,
        )


def run_container(
    client: docker.DockerClient,
    command: list[str],
    *,
    network: str,
    session: str,
    timeout: float,
    image: str = IMAGE,
    **kw: Any,
) -> RunResult:
    opts = HARDENED | {"labels": {LABEL: LABEL_VALUE, f"{LABEL}.session": session}} | kw
    c = client.containers.run(image, command, detach=True, network=network, **opts)
    try:
        try:
            code: int | None = int(c.wait(timeout=timeout)["StatusCode"])
        except Exception:  # the daemon's wait timed out (requests' ReadTimeout / ConnectionError)
            code = None
        out = c.logs(stdout=True, stderr=False).decode(errors="replace")
        err = c.logs(stdout=False, stderr=True).decode(errors="replace")
        return RunResult(code, out, err)
    finally:
        with contextlib.suppress(NotFound, APIError):
            c.remove(force=True)


# A probe run on the fresh network before any server starts. Docker 20.10 gives an internal network
# a default route via the subnet's first address, which nothing holds when the bridge has no IPv4
# (inhibit_ipv4): the route must be a dead end. The probe knocks on that address and connects to
# outside addresses (all must fail), then reads the neighbour table: the gateway address must
# have no link-layer address (ARP unanswered), so no packet can leave the container at all.
_PROBE = r"""
import json, socket, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
gw, outside = sys.argv[1], sys.argv[2:]
def run(*a):
    r = subprocess.run(a, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()
def knock(target):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect(target); return "connected"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return e.strerror or str(e)
    finally:
        s.close()
targets = [(gw, p) for p in (22, 53, 80, 443, 2375, 2376, 3128, 8080)] + [(o, 80) for o in outside]
with ThreadPoolExecutor(len(targets)) as ex:
    knocks = {f"{h}:{p}": r for (h, p), r in zip(targets, ex.map(knock, targets))}
print(json.dumps({
    "routes4": run("ip", "-4", "route").splitlines(),
    "routes6": run("ip", "-6", "route").splitlines(),
    "neighbour": run("ip", "neigh", "show", gw),
    "knocks": knocks,
}))
"""


def check_no_route_out(
    client: docker.DockerClient, network: str, subnet: str, session: str
) -> dict[str, Any]:
    """Fail unless, from a container on `network`, every route outside `subnet` is a dead end
    (its gateway address unanswered) and nothing outside or on the host side answers.
    Returns what the probe saw."""
    net = ipaddress.ip_network(subnet)
    gw = str(next(net.hosts()))
    res = run_container(
        client, ["python3", "-c", _PROBE, gw, *OUTSIDE], network=network, session=session, timeout=60
    )
    if res.exit_code != 0:
        raise RuntimeError(f"the network probe failed (exit {res.exit_code}): {res.stderr[-800:]}")
    seen = json.loads(res.stdout)
    problems = []
    for line in seen["routes4"]:
        words = line.split()
        if words[0] == "default":
            if words[1:3] != ["via", gw]:
                problems.append(f"a default route not via the dead gateway {gw}: {line!r}")
        elif not ipaddress.ip_network(words[0], strict=False).subnet_of(net):
            problems.append(f"an IPv4 route outside the test subnet: {line!r}")
    for line in seen["routes6"]:
        if line.split()[0] == "default":
            problems.append(f"an IPv6 default route: {line!r}")
    for target, outcome in seen["knocks"].items():
        if outcome == "connected":
            problems.append(f"{target} answered")
    if "lladdr" in seen["neighbour"]:
        problems.append(f"the gateway address {gw} answers ARP: {seen['neighbour']!r}")
    if problems:
        raise RuntimeError("the upstream test network is not sealed: " + "; ".join(problems))
    return seen


def _create_network(client: docker.DockerClient, name: str, session: str) -> tuple[Any, str]:
    """The upstreams' sealed network: internal, on a free /24 of SUBNET_POOL."""
    # No IPv4 address on the host's side of the bridge: nothing on the network reaches the
    # host's services (an --internal network alone still does).
    return create_on_free_subnet(
        client,
        name,
        options={"com.docker.network.bridge.inhibit_ipv4": "true"},
        labels={
            LABEL: LABEL_VALUE,
            f"{LABEL}.session": session,
            f"{LABEL}.pid": str(os.getpid()),
            f"{LABEL}.host": socket.gethostname(),
        },
    )


def create_on_free_subnet(
    client: docker.DockerClient, name: str, *, options: dict[str, str], labels: dict[str, str]
) -> tuple[Any, str]:
    """An internal bridge network on a free /24 of SUBNET_POOL, tried at random: sessions run side
    by side, and other test networks hold some of them (a fixed /24 once collided: "Pool
    overlaps"); when none of the tries is free, this says so."""
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    random.shuffle(subnets)
    last: Exception | None = None
    for sub in subnets[:32]:
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=str(sub))])
        try:
            net = client.networks.create(
                name,
                driver="bridge",
                internal=True,
                enable_ipv6=False,
                ipam=ipam,
                options=options,
                labels=labels,
            )
            return net, str(sub)
        except APIError as e:
            if "overlap" not in str(e).lower():
                raise
            last = e
    raise RuntimeError(f"no free /24 in {SUBNET_POOL} for network {name}: {last}")


def _sweep_dead_sessions(client: docker.DockerClient) -> None:
    """Remove what a killed test session of this host left (its pid is gone); never another
    live session's."""
    for net in client.networks.list(filters={"label": f"{LABEL}={LABEL_VALUE}"}):
        labels = net.attrs.get("Labels") or {}
        pid = labels.get(f"{LABEL}.pid", "")
        # Only this host's sessions (pids of another host or pid namespace mean nothing here).
        host = labels.get(f"{LABEL}.host", socket.gethostname())
        if host != socket.gethostname() or not pid.isdigit() or pid_alive(int(pid)):
            continue
        _remove_session(client, net, labels.get(f"{LABEL}.session", ""))


def _remove_session(client: docker.DockerClient, net: Any, session: str) -> None:
    """The session's containers, then its network. Another test's container still attached to
    it (a gateway it left behind) is only disconnected, so the network can go."""
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}.session={session}"}):
        with contextlib.suppress(NotFound, APIError):
            c.remove(force=True)
    with contextlib.suppress(NotFound, APIError):
        net.reload()
        for c in net.containers:
            with contextlib.suppress(NotFound, APIError):
                net.disconnect(c, force=True)
        net.remove()


def _start_server(
    client: docker.DockerClient, up: dict[str, Any], alias: str, mode: str, ca: TestCA, base: Path
) -> Upstream:
    cert = ca.issue(alias)
    log_dir = base / f"log-{alias}"
    log_dir.mkdir()
    log_dir.chmod(0o777)  # the server runs as uid 65534 and appends its request log here
    cmd = ["python3", "/srv/modelserver.py", "--mode", mode, "--name", alias, "--log-dir", "/log"]
    cmd += [a for p in HTTP_PORTS for a in ("--http-port", str(p))]
    cmd += [a for p in HTTPS_PORTS for a in ("--https-port", str(p))]
    if mode == "static":
        cmd += ["--banner-port", str(BANNER_PORT)]
    cmd += ["--cert", "/certs/server.crt", "--key", "/certs/server.key"]
    volumes = {
        str(SERVER_PY): {"bind": "/srv/modelserver.py", "mode": "ro"},
        str(cert.cert): {"bind": "/certs/server.crt", "mode": "ro"},
        str(cert.key): {"bind": "/certs/server.key", "mode": "ro"},
        str(log_dir): {"bind": "/log", "mode": "rw"},
    }
    if mode == "model":
        cmd += ["--script", "/script/script.json"]
        volumes[str(up["script_dir"])] = {"bind": "/script", "mode": "ro"}
    net = up["network"]
    name = f"fila-test-up-{up['session']}-{alias.replace('.', '-')}"
    c = client.containers.run(
        IMAGE,
        cmd,
        name=name,
        detach=True,
        network=net,
        networking_config={net: client.api.create_endpoint_config(aliases=[alias])},
        volumes=volumes,
        # uid 65534 binds 80 and 443 without any capability.
        sysctls={"net.ipv4.ip_unprivileged_port_start": "0"},
        **(
            HARDENED
            | {"labels": {LABEL: LABEL_VALUE, f"{LABEL}.session": up["session"], f"{LABEL}.server": alias}}
        ),
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (log_dir / "ready").exists():
        c.reload()
        if c.status not in ("created", "running") or time.monotonic() > deadline:
            logs = c.logs().decode(errors="replace")[-1500:]
            raise RuntimeError(f"test server {alias} did not become ready ({c.status}): {logs}")
        time.sleep(0.05)
    c.reload()
    ip = c.attrs["NetworkSettings"]["Networks"][net]["IPAddress"]
    return Upstream(alias=alias, ip=ip, container=name, log_dir=log_dir, mode=mode)


@contextlib.contextmanager
def start_upstreams(client: docker.DockerClient, base: Path) -> Iterator[Upstreams]:
    """Everything the fixture does, usable outside pytest (bench/, a shell)."""
    ensure_image("testnet", DockerBackend(client), progress=lambda line: None)
    _sweep_dead_sessions(client)
    session = uuid.uuid4().hex[:10]
    name = f"fila-test-upstreams-{session}"
    ca = make_ca(base / "ca")
    script_dir = base / "script"
    script_dir.mkdir()
    script_dir.chmod(0o755)
    net, subnet = _create_network(client, name, session)
    try:
        probe = check_no_route_out(client, name, subnet, session)
        up = {"network": name, "session": session, "script_dir": script_dir}
        servers = {MODEL: _start_server(client, up, MODEL, "model", ca, base)}
        for alias in STATIC:
            servers[alias] = _start_server(client, up, alias, "static", ca, base)
        ups = Upstreams(
            network=name,
            subnet=subnet,
            ca=ca,
            servers=servers,
            script_file=script_dir / "script.json",
            session=session,
            docker=client,
            probe=probe,
        )
        ups.set_script([])
        yield ups
    finally:
        _remove_session(client, net, session)


@pytest.fixture(scope="session")
def upstreams(
    docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Upstreams]:
    """The test upstream servers (see tests/upstreams/README.md). Fails, never skips, when the
    network cannot be proven sealed: a test must not send a packet off this machine."""
    base = tmp_path_factory.mktemp("upstreams")
    base.chmod(0o755)
    try:
        cm = start_upstreams(docker_client, base)
        ups = cm.__enter__()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield ups
    finally:
        cm.__exit__(None, None, None)
