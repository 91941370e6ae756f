"""The egress gateway container (images/gateway) against real upstream servers.

A client container (fila/testnet, curl) sits on a job-like network (`--internal`, no IPv4 on the
host side) whose only other member is the gateway; the gateway is also on the upstreams' sealed
network (tests/upstreams). Every refusal is shown after its allowed counterpart succeeded in the
same test, so each test can fail.
"""

from __future__ import annotations

import base64
import contextlib
import html
import ipaddress
import json
import os
import re
import shlex
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import APIError, NotFound

from fila.sandbox.images import GATEWAY_IMAGE
from tests.support.learn import as_read
from tests.upstreams.fixtures import (
    CA_IN_CONTAINER,
    HARDENED,
    IMAGE,
    Upstreams,
    check_no_route_out,
    create_on_free_subnet,
)

pytestmark = pytest.mark.docker

LABEL = "fila.test"
LABEL_VALUE = "gateway"
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")
REAL_KEY = "sk-ant-REAL-" + uuid.uuid4().hex
REAL_OPENAI_KEY = "sk-openai-REAL-" + uuid.uuid4().hex
PLACEHOLDER = "fila-placeholder"
FIELDS = {
    "t",
    "id",
    "door",
    "method",
    "host",
    "port",
    "route",
    "path",
    "allowed",
    "reason",
    "status",
    "bytes_in",
    "bytes_out",
    "usage",
    "budget",
    "scrubbed",
}
CURL = f"curl -sS --max-time 15 --cacert {CA_IN_CONTAINER}"


@dataclass
class Gw:
    """One running gateway: its container, its address on the job network, its log."""

    container: Any
    ip: str
    log_dir: Path
    egress_ip: str  # its address on the upstreams' network

    @property
    def proxy(self) -> str:
        return f"http://{self.ip}:3128"

    @property
    def routes(self) -> str:
        return f"http://{self.ip}:8080"

    def raw_log(self) -> list[dict[str, Any]]:
        path = self.log_dir / "egress.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.strip()]

    def log(self) -> list[dict[str, Any]]:
        """The log as fila reads it: a request's final line replaces its in-flight one."""
        return as_read(self.raw_log())

    def last(self, **match: Any) -> dict[str, Any]:
        """The newest final log line whose fields equal `match` (a route call's final line is
        written as its response ends, a moment after the client has it all; until then its line
        says "in flight", which only a `reason="in flight"` match asks for): waits for it."""
        deadline = time.monotonic() + 5
        final = "reason" in match or (lambda e: e.get("reason") != "in flight")
        while True:
            hits = [
                e
                for e in self.log()
                if all(e.get(k) == v for k, v in match.items()) and (final is True or final(e))
            ]
            if hits or time.monotonic() > deadline:
                assert hits, f"no log line with {match}; log: {self.log()[-5:]}"
                return hits[-1]
            time.sleep(0.05)

    def summary(self) -> dict[str, Any]:
        """summary.json once every call the log shows has ended (the gateway rewrites it as each
        route call's final line is written, a moment after the client has the answer)."""
        path = self.log_dir / "summary.json"
        deadline = time.monotonic() + 10
        while True:
            doc = json.loads(path.read_text()) if path.exists() else None
            settled = all(e.get("reason") != "in flight" for e in self.log())
            if (doc is not None and doc.get("in_flight") == 0 and settled) or time.monotonic() > deadline:
                assert doc is not None, f"no {path}"
                return doc
            time.sleep(0.05)

    def final(self) -> dict[str, Any]:
        """The newest line once it is a final one (a route call's last line is written as its
        response ends, a moment after the client has it all)."""
        deadline = time.monotonic() + 5
        while (line := self.log()[-1])["reason"] == "in flight" and time.monotonic() < deadline:
            time.sleep(0.05)
        return line


@dataclass
class Env:
    docker: docker.DockerClient
    ups: Upstreams
    job_net: str
    job_subnet: str
    client: Any
    tmp: Path
    session: str

    def sh(self, cmd: str, client: Any = None, timeout: int = 40) -> tuple[int, str, str]:
        """Run `cmd` with sh in the client container: (exit code, stdout, stderr)."""
        c = client or self.client
        code, (out, err) = c.exec_run(["timeout", str(timeout), "sh", "-c", cmd], demux=True)
        return code, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace")

    def gateway(self, **config: Any) -> Gw:
        """A gateway with this config (`clients` defaults to the job network, as fila sets it)."""
        return start_gateway(self, **config)


def _labels(session: str) -> dict[str, str]:
    return {LABEL: LABEL_VALUE, f"{LABEL}.session": session, f"{LABEL}.pid": str(os.getpid())}


def _chown_nobody(path: Path, mode: int) -> None:
    os.chown(path, 65534, 65534)  # the gateway runs as 65534, like fila writes it for a job
    path.chmod(mode)


def start_gateway(
    env: Env,
    *,
    allow: list[dict[str, Any]] | None = None,
    allow_private: list[str] | None = None,
    routes: dict[str, Any] | None = None,
    budget: dict[str, Any] | None = None,
    clients: list[str] | None = None,
    upstream_ca: str | None = "/etc/fila-gateway/upstream-ca.pem",
    environment: dict[str, str] | None = None,
    host_addresses: list[str] | None = None,
    secrets: dict[str, str] | None = None,
) -> Gw:
    """A hardened gateway on the job network and the upstream network, as the contract says.
    With routes and no `allow_private` given, the upstreams' subnet is opened (every test server,
    the model server among them, has a private address there, which a route connects to only
    when allow_private opens it); `secrets`: more files of its secrets directory."""
    if allow_private is None:
        allow_private = _private(env) if routes else []
    name = f"fila-test-gw-{env.session}-{uuid.uuid4().hex[:6]}"
    d = env.tmp / name
    (d / "secrets").mkdir(parents=True)
    (d / "log").mkdir()
    (d / "secrets" / "anthropic").write_text(REAL_KEY + "\n")
    (d / "secrets" / "openai").write_text(REAL_OPENAI_KEY)
    for name, value in (secrets or {}).items():
        (d / "secrets" / name).write_text(value)
    for f in (d / "secrets").iterdir():
        _chown_nobody(f, 0o600)
    _chown_nobody(d / "secrets", 0o700)
    _chown_nobody(d / "log", 0o700)
    config = {
        "job": name,
        "allow": allow or [],
        "allow_private": allow_private,
        "routes": routes or {},
        "budget": budget or {"max_requests": None, "max_tokens": None},
        "upstream_ca": upstream_ca,
        "clients": clients or [env.job_subnet],
        "host_addresses": host_addresses or [],
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "config.json").chmod(0o644)
    c = env.docker.containers.create(
        GATEWAY_IMAGE,
        name=name,
        network=env.job_net,
        user="65534:65534",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=64m"},
        mem_limit="256m",
        pids_limit=128,
        # The DNS door binds 53 as uid 65534 (fila starts the gateway the same way).
        sysctls={"net.ipv4.ip_unprivileged_port_start": "53"},
        labels={**_labels(env.session), "fila.role": "gateway"},
        environment=environment or {},
        volumes={
            str(d / "config.json"): {"bind": "/etc/fila-gateway/config.json", "mode": "ro"},
            str(d / "secrets"): {"bind": "/run/fila-gateway/secrets", "mode": "ro"},
            str(d / "log"): {"bind": "/var/log/fila-gateway", "mode": "rw"},
            str(env.ups.ca_file): {"bind": "/etc/fila-gateway/upstream-ca.pem", "mode": "ro"},
        },
    )
    env.docker.networks.get(env.ups.network).connect(c)
    c.start()
    deadline = time.monotonic() + 30
    while not (d / "log" / "ready").exists():
        c.reload()
        if c.status != "running" or time.monotonic() > deadline:
            pytest.fail(f"gateway not ready ({c.status}): {c.logs().decode(errors='replace')[-2000:]}")
        time.sleep(0.05)
    c.reload()
    nets = c.attrs["NetworkSettings"]["Networks"]
    return Gw(c, nets[env.job_net]["IPAddress"], d / "log", nets[env.ups.network]["IPAddress"])


def _job_network(client: docker.DockerClient, session: str) -> tuple[str, str]:
    """A network like fila's per-job one: internal, no IPv4 on the host side, no IPv6."""
    name = f"fila-test-jobnet-{session}"
    options = {"com.docker.network.bridge.inhibit_ipv4": "true"}
    _net, subnet = create_on_free_subnet(client, name, options=options, labels=_labels(session))
    return name, subnet


def _client(env_docker: docker.DockerClient, net: str, session: str, ups: Upstreams, **kw: Any) -> Any:
    opts = HARDENED | {"labels": _labels(session)} | kw
    return env_docker.containers.run(
        IMAGE,
        ["sleep", "infinity"],
        detach=True,
        network=net,
        volumes={str(ups.ca_file): {"bind": CA_IN_CONTAINER, "mode": "ro"}},
        **opts,
    )


@pytest.fixture(scope="module")
def env(
    docker_client: docker.DockerClient,
    upstreams: Upstreams,
    gateway_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    session = uuid.uuid4().hex[:10]
    tmp = tmp_path_factory.mktemp("gateway")
    tmp.chmod(0o755)
    net, subnet = _job_network(docker_client, session)
    try:
        # The job network must be as sealed as the upstreams' before anything runs on it.
        check_no_route_out(docker_client, net, subnet, session)
        client = _client(docker_client, net, session, upstreams)
        yield Env(docker_client, upstreams, net, subnet, client, tmp, session)
    finally:
        # About forty gateways by now, all on the job network: stopped one at a time (two
        # containers leaving one network at once can deadlock Docker 20.10:
        # sandbox/docker/removal.py), then the stopped ones removed four at a time (one by one,
        # stops and all, took about 11 s).
        def remove(c: Any) -> None:
            with contextlib.suppress(NotFound, APIError):
                c.remove(force=True)

        left = docker_client.containers.list(all=True, filters={"label": f"{LABEL}.session={session}"})
        for c in left:
            with contextlib.suppress(NotFound, APIError):
                c.kill()
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(remove, left))
        with contextlib.suppress(NotFound, APIError):
            docker_client.networks.get(net).remove()


def _private(env: Env) -> list[str]:
    return [env.ups.subnet]


def raw_connect(env: Env, gw: Gw, target: str, then: str = "") -> str:
    """Send `CONNECT target` by hand (curl normalises odd hosts itself); print the proxy's status
    line and, after a 200, what comes back for the bytes `then` sent inside the tunnel."""
    script = (
        "import socket,sys\n"
        f"s=socket.create_connection(({gw.ip!r},3128),timeout=8)\n"
        f"s.sendall(b'CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n')\n"
        "head=b''\n"
        "while b'\\r\\n\\r\\n' not in head:\n"
        "    d=s.recv(4096)\n"
        "    if not d: break\n"
        "    head+=d\n"
        "print(head.split(b'\\r\\n')[0].decode())\n"
        f"inner={then.encode()!r}\n"
        "if inner and b' 200' in head.split(b'\\r\\n')[0]:\n"
        "    s.sendall(inner); out=b''\n"
        "    try:\n"
        "        while True:\n"
        "            d=s.recv(65536)\n"
        "            if not d: break\n"
        "            out+=d\n"
        "    except OSError as e:\n"
        "        out+=b'<'+str(e).encode()+b'>'\n"
        "    print('INNER', out.decode(errors='replace'))\n"
    )
    code, out, err = env.sh(f"python3 -c {shlex.quote(script)}")
    assert code == 0, err
    return out


# ---------------------------------------------------------------- the proxy door


@pytest.mark.quick
def test_connect_tunnels_tls_untouched_to_a_listed_host_and_refuses_every_other_target(env: Env) -> None:
    allowed_ip = env.ups.ip("allowed.test")
    gw = env.gateway(
        allow=[
            {"host": "allowed.test", "port": 443, "methods": None},
            {"host": "localhost", "port": 443, "methods": None},  # listed, still refused
            {"host": "metadata.internal", "port": 443, "methods": None},
        ],
        allow_private=_private(env),
    )
    # Allowed: HTTPS through the tunnel, the server's certificate verified by the client against
    # the test CA alone (so the gateway did not intercept: the client trusts no gateway CA).
    code, out, err = env.sh(f"{CURL} -v -x {gw.proxy} https://allowed.test/")
    assert code == 0, err
    assert out.strip() == "hello from allowed.test"
    assert "issuer: CN=fila test CA" in err
    line = gw.last(method="CONNECT", host="allowed.test")
    assert line["allowed"] is True and line["status"] == 200 and line["port"] == 443
    assert line["bytes_in"] > 0 and line["bytes_out"] > 0  # the TLS handshake and the reply
    # Logged as it opened (in flight), then as it ended, one id: a gateway stopped while a tunnel
    # is open leaves its trace in the record (egress.halt kills it before the log is read).
    opened, ended = [e for e in gw.raw_log() if e["method"] == "CONNECT" and e["host"] == "allowed.test"]
    assert (opened["reason"], opened["status"], opened["allowed"]) == ("in flight", None, True), opened
    assert opened["id"] and ended["id"] == opened["id"] and ended["status"] == 200, ended

    refused = {
        "https://denied.test/": ("denied.test", 443, "not in allowlist"),
        "https://allowed.test:8443/": ("allowed.test", 8443, "not in allowlist"),  # served, not listed
        f"https://{allowed_ip}/": (allowed_ip, 443, "ip literal"),
        "https://localhost/": ("localhost", 443, "reserved name"),
        "https://metadata.internal/": ("metadata.internal", 443, "reserved name"),
        # userinfo: curl sends the part after @ as the host, which is not listed
        "https://allowed.test@denied.test/": ("denied.test", 443, "not in allowlist"),
    }
    for url, (host, port, reason) in refused.items():
        code, out, err = env.sh(f"{CURL} -x {gw.proxy} {shlex.quote(url)}")
        assert code != 0 and "403" in err, (url, out, err)
        line = gw.last(method="CONNECT", host=host, port=port)
        assert line["allowed"] is False and line["reason"] == reason and line["status"] == 403, line

    # Literal forms curl would normalise, sent by hand: IPv6, decimal, hex, short, userinfo.
    for target, reason in {
        "[::1]:443": "ip literal",
        f"[::ffff:{allowed_ip}]:443": "ip literal",
        "2130706433:443": "ip literal",
        "0x7f000001:443": "ip literal",
        "127.1:443": "ip literal",
        f"{int(ipaddress.ip_address(allowed_ip))}:443": "ip literal",
    }.items():
        out = raw_connect(env, gw, target)
        assert " 403" in out.splitlines()[0], (target, out)
        assert gw.log()[-1]["reason"] == reason and gw.log()[-1]["allowed"] is False, (target, gw.log()[-1])
    out = raw_connect(env, gw, "allowed.test@denied.test:443")
    assert " 400" in out.splitlines()[0], out  # mitmproxy's parser refuses it; the gateway logs it
    line = gw.last(host="allowed.test@denied.test:443")
    assert line["allowed"] is False and line["method"] == "CONNECT"
    assert line["reason"].startswith("malformed request: Bad HTTP request line"), line
    assert env.ups.requests("denied.test") == []  # nothing ever reached denied.test


def test_a_wildcard_entry_opens_the_names_below_it_and_not_the_name_itself(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "*.allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://other.allowed.test/")
    assert code == 0 and out.strip() == "hello from other.allowed.test", err
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code != 0 and "403" in err
    assert gw.last(host="allowed.test")["reason"] == "not in allowlist"


def test_a_listed_name_that_resolves_to_a_private_address_is_refused_unless_allow_private_covers_it(
    env: Env,
) -> None:
    allow = [{"host": "allowed.test", "port": 443, "methods": None}]
    open_gw = env.gateway(allow=allow, allow_private=_private(env))
    code, out, err = env.sh(f"{CURL} -x {open_gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err

    closed_gw = env.gateway(allow=allow, allow_private=[])
    code, out, err = env.sh(f"{CURL} -x {closed_gw.proxy} https://allowed.test/")
    assert code != 0 and "403" in err
    line = closed_gw.last(method="CONNECT", host="allowed.test")
    assert line["allowed"] is False
    assert line["reason"] == f"private address {env.ups.ip('allowed.test')}"

    # A range that does not hold the address opens nothing.
    other_gw = env.gateway(allow=allow, allow_private=["10.99.0.0/16"])
    code, _, err = env.sh(f"{CURL} -x {other_gw.proxy} https://allowed.test/")
    assert code != 0 and "403" in err


def test_the_tunnel_is_raw_so_host_headers_and_nested_connects_cannot_reach_an_unlisted_server(
    env: Env,
) -> None:
    gw = env.gateway(
        allow=[
            {"host": "allowed.test", "port": 443, "methods": None},
            {"host": "allowed.test", "port": 80, "methods": None},
        ],
        allow_private=_private(env),
    )
    env.ups.clear_requests("denied.test")
    env.ups.clear_requests("allowed.test")
    # Host header naming denied.test inside a tunnel to allowed.test: the upstream that answers
    # is allowed.test (the tunnel goes where the checked name resolved, whatever is inside).
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} -H 'Host: denied.test' https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    assert env.ups.requests("allowed.test")[-1]["headers"]["host"] == "denied.test"

    # A tunnel carries TLS only: plain bytes inside it (an absolute-URL request, a nested
    # CONNECT, a Host naming denied.test) are closed before they reach allowed.test, and logged.
    before = len(env.ups.requests("allowed.test"))
    for inner in (
        "GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n",
        "CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n",
    ):
        for target in ("allowed.test:80", "allowed.test:443"):
            out = raw_connect(env, gw, target, then=inner)
            assert " 200" in out.splitlines()[0] and out.split("INNER", 1)[1].strip() == "", out
            line = gw.last(method="CONNECT", allowed=False, port=int(target.split(":")[1]))
            assert line["reason"] == "tunnel closed: not a TLS handshake", line
    assert len(env.ups.requests("allowed.test")) == before
    # CONNECT to the gateway itself (a relay through its own port) is an IP literal.
    out = raw_connect(env, gw, f"{gw.ip}:3128")
    assert " 403" in out.splitlines()[0]
    assert gw.log()[-1]["reason"] == "ip literal"
    assert env.ups.requests("denied.test") == []


def test_a_tunnel_carrying_a_tls_handshake_for_another_name_is_closed(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )
    s_client = (
        f"echo | openssl s_client -proxy {gw.ip}:3128 -connect allowed.test:443 -CAfile {CA_IN_CONTAINER}"
    )
    # The handshake through the tunnel is the point: verified, the listed host's certificate. Its
    # exit code is not: `echo |` closes stdin at once and OpenSSL 3 exits 1 when the upstream then
    # closes without close_notify ("unexpected eof while reading"), depending on timing.
    _code, out, err = env.sh(f"{s_client} -servername allowed.test")
    assert "Verify return code: 0 (ok)" in out and "CN = allowed.test" in out, err
    # The same tunnel with the TLS server name of an unlisted host (domain fronting): closed
    # before the handshake reaches the upstream.
    code, out, err = env.sh(f"{s_client} -servername denied.test")
    assert code != 0 and "no peer certificate available" in out and "CN = allowed.test" not in out, out
    line = gw.last(method="CONNECT", allowed=False)
    assert (
        line["host"] == "allowed.test"
        and line["reason"] == "tls server name denied.test is not the CONNECT host"
    )


def test_a_listed_port_with_nothing_listening_answers_502_and_is_logged(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": p, "methods": None} for p in (443, 9443)],
        allow_private=_private(env),
    )
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test:9443/")
    assert code != 0 and "502" in err, err
    line = gw.last(method="CONNECT", port=9443)
    assert line["allowed"] is True and line["status"] == 502 and line["reason"].startswith("upstream:")


def test_plain_http_through_the_proxy_checks_host_port_method_and_header_size(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 80, "methods": ["GET", "HEAD"]}],
        allow_private=_private(env),
    )
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} http://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    line = gw.last(method="GET", host="allowed.test")
    assert line["allowed"] is True and line["status"] == 200 and line["door"] == "proxy"
    assert line["bytes_in"] == len("hello from allowed.test\n")

    cases = [
        ("http://denied.test/", "", 403, "denied.test", "GET", "not in allowlist"),
        ("http://allowed.test:8080/", "", 403, "allowed.test", "GET", "not in allowlist"),
        ("http://allowed.test/", "-X POST -d x=1", 405, "allowed.test", "POST", "method not allowed"),
        (
            "http://allowed.test/",
            "-H 'Host: denied.test'",
            403,
            "allowed.test",
            "GET",
            "host header differs from the URL",
        ),
        (f"http://{env.ups.ip('allowed.test')}/", "", 403, env.ups.ip("allowed.test"), "GET", "ip literal"),
        ("http://localhost/", "", 403, "localhost", "GET", "reserved name"),
    ]
    for url, extra, status, host, method, reason in cases:
        code, out, err = env.sh(f"{CURL} -o /dev/null -w '%{{http_code}}' -x {gw.proxy} {extra} {url}")
        assert out == str(status), (url, out, err)
        line = gw.last(method=method, host=host)
        assert line["allowed"] is False and line["reason"] == reason and line["status"] == status, line

    # HTTP/2 (prior knowledge) to the proxy: the same checks.
    h2 = f"{CURL} --http2-prior-knowledge -o /dev/null -w '%{{http_code}}' -x {gw.proxy}"
    assert env.sh(f"{h2} http://allowed.test/")[1] == "200"
    assert env.sh(f"{h2} http://denied.test/")[1] == "403"
    assert gw.last(host="denied.test")["reason"] == "not in allowlist"

    # Very long headers: the same allowed request, refused once its headers pass 32 KiB.
    big = "a" * 40000
    code, out, _ = env.sh(
        f"{CURL} -o /dev/null -w '%{{http_code}}' -x {gw.proxy} -H 'X-Pad: {big[:100]}' http://allowed.test/"
    )
    assert out == "200"
    code, out, _ = env.sh(
        f"{CURL} -o /dev/null -w '%{{http_code}}' -x {gw.proxy} -H 'X-Pad: {big}' http://allowed.test/"
    )
    assert out == "431"
    assert gw.log()[-1]["reason"].startswith("headers larger than") and gw.log()[-1]["allowed"] is False
    assert all(
        len(r.get("headers", {}).get("x-pad", "")) < 1000 for r in env.ups.requests("allowed.test")
    )  # the big one never left the gateway


def test_the_engine_has_no_route_and_no_resolver_only_the_gateway_resolves(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )
    # The client as fila will start the engine: its resolver is the gateway.
    engine = _client(env.docker, env.job_net, env.session, env.ups, dns=[gw.ip])
    try:
        code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/", client=engine)
        assert code == 0 and out.strip() == "hello from allowed.test", err
        # The gateway resolves the name...
        code, out = gw.container.exec_run(
            ["python3", "-c", "import socket; print(socket.gethostbyname('allowed.test'))"]
        )
        assert code == 0 and out.decode().strip() == env.ups.ip("allowed.test")
        # ...the engine cannot, neither that name nor an outside one, nor by asking any server.
        for name in ("allowed.test", "denied.test", "example.com"):
            code, out, _ = env.sh(f"getent hosts {name}", client=engine)
            assert code != 0 and out == "", (name, out)
        # Every lookup reached the gateway's DNS door, which refused it and logged it.
        dns = [e for e in gw.log() if e["door"] == "dns"]
        assert {"allowed.test", "denied.test", "example.com"} <= {e["host"] for e in dns}, dns
        assert all(e["allowed"] is False and e["method"] in ("A", "AAAA") for e in dns)
        code, out, _ = env.sh("dig +time=2 +tries=1 +short example.com", client=engine)
        assert env.ups.ip("allowed.test") not in out and not any(c.isdigit() for c in out.split(";")[0]), out
        # No route: the upstream network is not reachable without the proxy.
        code, _, err = env.sh(
            f"{CURL} --noproxy '*' --connect-timeout 3 https://{env.ups.ip('allowed.test')}/", client=engine
        )
        assert code != 0, err
    finally:
        engine.remove(force=True)


# ---------------------------------------------------------------- the route door


def _routes(env: Env) -> dict[str, Any]:
    return {
        "anthropic": {
            "upstream": "https://model.test",
            "header": "x-api-key",
            "format": "{key}",
            "secret": "anthropic",
        },
        "openai": {
            "upstream": "https://model.test/v1",
            "header": "authorization",
            "format": "Bearer {key}",
            "secret": "openai",
        },
    }


ANTHROPIC_BODY = {"model": "claude-test", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


def _post(env: Env, url: str, body: dict[str, Any], *headers: str) -> tuple[str, str]:
    """POST JSON with curl -i from the client: (status, everything the client received)."""
    hs = " ".join(f"-H {shlex.quote(h)}" for h in ("content-type: application/json", *headers))
    code, out, err = env.sh(f"{CURL} -i -N {hs} --data-binary {shlex.quote(json.dumps(body))} {url}")
    assert code == 0, err
    return out.split(" ", 2)[1], out


def test_model_routes_add_the_real_key_drop_the_engines_and_meter_usage(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.clear_requests("model.test")
    env.ups.set_script(
        [
            {
                "protocol": "anthropic",
                "reply": {"text": "plain"},
                "usage": {"input_tokens": 12, "output_tokens": 7},
            },
            {
                "protocol": "anthropic",
                "reply": {"text": "streamed"},
                "usage": {"input_tokens": 20, "output_tokens": 9},
            },
            {
                "protocol": "openai",
                "reply": {"text": "chat"},
                "usage": {"input_tokens": 31, "output_tokens": 4},
            },
        ]
    )
    seen = []
    status, out = _post(
        env,
        f"{gw.routes}/anthropic/v1/messages",
        ANTHROPIC_BODY,
        f"x-api-key: {PLACEHOLDER}",
        f"authorization: Bearer {PLACEHOLDER}",
        "anthropic-version: 2023-06-01",
    )
    assert status == "200" and "plain" in out
    seen.append(out)
    status, out = _post(
        env,
        f"{gw.routes}/anthropic/v1/messages",
        {**ANTHROPIC_BODY, "stream": True},
        f"x-api-key: {PLACEHOLDER}",
    )
    assert status == "200" and "text/event-stream" in out and "event: message_delta" in out
    seen.append(out)
    status, out = _post(
        env,
        f"{gw.routes}/openai/chat/completions?key={PLACEHOLDER}",
        {
            "model": "gpt-test",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}],
        },
        f"authorization: Bearer {PLACEHOLDER}",
        f"x-goog-api-key: {PLACEHOLDER}",
        f"api-key: {PLACEHOLDER}",
    )
    assert status == "200" and "[DONE]" in out
    seen.append(out)

    reqs = env.ups.requests("model.test")
    assert [r["path"] for r in reqs] == ["/v1/messages", "/v1/messages", "/v1/chat/completions"]
    for r, key, header in zip(
        reqs, (REAL_KEY, REAL_KEY, REAL_OPENAI_KEY), ("x-api-key", "x-api-key", "authorization"), strict=True
    ):
        text = json.dumps(r)
        assert text.count(key) == 1, r  # the real key, exactly once, in its header
        assert PLACEHOLDER not in text, r  # every credential the engine sent was dropped
        assert key in r["headers"][header]
    assert reqs[2]["headers"]["authorization"] == f"Bearer {REAL_OPENAI_KEY}"
    assert "key" not in (reqs[2].get("query") or {})
    for out in seen:
        assert REAL_KEY not in out and REAL_OPENAI_KEY not in out  # the client never sees it

    # An engine that sends its model URL to the proxy (ignoring NO_PROXY) reaches the route too;
    # any other address of the gateway through the proxy is an IP literal.
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "via proxy"}}])
    status, out = _post(env, f"-x {gw.proxy} {gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "via proxy" in out
    assert env.ups.requests("model.test")[-1]["headers"]["x-api-key"] == REAL_KEY
    status, out = _post(env, f"-x {gw.proxy} http://{gw.ip}:3128/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "403" and "ip literal" in out

    lines = [e for e in gw.log() if e["door"] == "route"]
    assert [(e["route"], e["path"], e["status"], e["usage"]) for e in lines] == [
        ("anthropic", "/v1/messages", 200, {"input_tokens": 12, "output_tokens": 7}),
        ("anthropic", "/v1/messages", 200, {"input_tokens": 20, "output_tokens": 9}),
        ("openai", "/chat/completions", 200, {"input_tokens": 31, "output_tokens": 4}),
        ("anthropic", "/v1/messages", 200, {"input_tokens": 10, "output_tokens": 5}),
    ]
    assert all(e["allowed"] and e["host"] == "model.test" and e["port"] == 443 for e in lines)
    assert all(e["bytes_in"] > 0 and e["bytes_out"] > 0 for e in lines)
    assert REAL_KEY not in (gw.log_dir / "egress.jsonl").read_text()


def test_a_route_connects_only_to_its_checked_address_under_its_upstreams_name(env: Env) -> None:
    """A route resolves its upstream itself and checks every address as the proxy door checks a
    listed name's (private outside allow_private, the gateway's host), then connects to that very
    address with the upstream's name as the Host header and the TLS server name (the model
    server's certificate names model.test only: a handshake for the address would fail)."""
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "through the route"}}])
    env.ups.clear_requests("model.test")
    gw = env.gateway(routes=_routes(env))  # allow_private opens the upstreams' subnet
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "through the route" in out, out
    assert env.ups.requests("model.test")[-1]["headers"]["host"] == "model.test"
    model_ip = env.ups.ip("model.test")
    for closed, says in (
        (env.gateway(routes=_routes(env), allow_private=[]), f"private address {model_ip}"),
        (
            env.gateway(routes=_routes(env), host_addresses=[model_ip]),
            f"address of the gateway's host {model_ip}",
        ),
    ):
        env.ups.clear_requests("model.test")
        status, out = _post(env, f"{closed.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
        assert status == "403" and says in out, out
        assert env.ups.requests("model.test") == []  # nothing reached the upstream, no key sent
        line = closed.last(door="route", allowed=False)
        assert line["route"] == "anthropic" and says in line["reason"], line


OVERRIDES = (
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-url",
    "x-rewrite-url",
)


def test_a_route_drops_method_and_path_overrides_and_refuses_a_body_on_a_read(env: Env) -> None:
    """A route's rules check the request line: what some servers read instead of it (a method
    override, an original or rewritten URL) never reaches the upstream, and a read (GET, HEAD)
    with a body, which no rule names, is refused."""
    token = base64.b64encode(b"corp:route-password-5e1c").decode()
    corp = {"upstream": "https://allowed.test/repo", "header": "authorization", "format": "Basic {key}",
            "secret": "corp", "paths": ["GET /repo/**", "HEAD /repo/**"]}  # fmt: skip
    gw = env.gateway(routes={"corp": corp}, secrets={"corp": token})
    env.ups.clear_requests("allowed.test")
    hs = " ".join(f"-H '{h}: DELETE /admin/keys'" for h in OVERRIDES)
    code, out, err = env.sh(f"{CURL} -i {hs} {gw.routes}/corp/simple/six/")
    assert code == 0 and out.startswith("HTTP/1.1 200") and "hello from allowed.test" in out, (out, err)
    (got,) = env.ups.requests("allowed.test")
    assert (got["method"], got["path"]) == ("GET", "/repo/simple/six/"), got
    assert got["headers"]["authorization"] == f"Basic {token}"
    assert not set(OVERRIDES) & set(got["headers"]), got["headers"]
    for body in ("--data-binary x", "-H 'transfer-encoding: chunked' --data-binary x"):
        code, out, err = env.sh(f"{CURL} -i -X GET {body} {gw.routes}/corp/simple/six/")
        assert code == 0 and out.startswith("HTTP/1.1 400") and "a body on GET" in out, (out, err)
    assert len(env.ups.requests("allowed.test")) == 1  # neither reached the upstream
    assert gw.last(door="route", allowed=False)["reason"] == "a body on GET"


def test_usage_is_read_from_responses_and_gemini_streams_too(env: Env) -> None:
    routes = {
        **_routes(env),
        "gemini": {
            "upstream": "https://model.test",
            "header": "x-goog-api-key",
            "format": "{key}",
            "secret": "anthropic",
        },
    }
    gw = env.gateway(routes=routes)
    env.ups.set_script(
        [
            {
                "protocol": "responses",
                "reply": {"text": "r"},
                "usage": {"input_tokens": 40, "output_tokens": 6},
            },
            {"protocol": "gemini", "reply": {"text": "g"}, "usage": {"input_tokens": 50, "output_tokens": 8}},
            {"protocol": "gemini", "reply": {"text": "g2"}, "usage": {"input_tokens": 3, "output_tokens": 2}},
        ]
    )
    status, out = _post(env, f"{gw.routes}/openai/responses", {"model": "m", "input": "hi", "stream": True})
    assert status == "200" and "response.completed" in out
    url = f"{gw.routes}/gemini/v1beta/models/g:streamGenerateContent?alt=sse&key={PLACEHOLDER}"
    status, out = _post(env, url, {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
    assert status == "200" and "usageMetadata" in out
    status, out = _post(env, f"{gw.routes}/gemini/v1beta/models/g:generateContent", {"contents": []})
    assert status == "200"
    lines = [e for e in gw.log() if e["door"] == "route"]
    assert [(e["route"], e["usage"]) for e in lines] == [
        ("openai", {"input_tokens": 40, "output_tokens": 6}),
        ("gemini", {"input_tokens": 50, "output_tokens": 8}),
        ("gemini", {"input_tokens": 3, "output_tokens": 2}),
    ]
    gemini = env.ups.requests("model.test")[-2]
    assert gemini["query"] == {"alt": ["sse"]}  # the engine's key= is gone
    assert gemini["headers"]["x-goog-api-key"] == REAL_KEY


def test_upstream_errors_pass_through_and_an_unknown_route_is_refused(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script(
        [
            {"protocol": "anthropic", "reply": {"text": "ok"}},
            {"protocol": "anthropic", "error": {"status": 429}},
            {"protocol": "anthropic", "error": {"status": 401}},
            {"protocol": "anthropic", "error": {"status": 500}},
        ]
    )
    for want in ("200", "429", "401", "500"):
        status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
        assert status == want, out
    gw.last(route="anthropic", status=500)  # each call's final line is written as its response ends
    lines = [e for e in gw.log() if e["route"] == "anthropic"]
    assert [(e["status"], e["allowed"]) for e in lines] == [
        (200, True),
        (429, True),
        (401, True),
        (500, True),
    ]
    assert "rate_limit_error" in out or status == "500"

    # A route whose upstream does not answer: 502 to the engine, logged with the reason.
    down = {
        "upstream": "https://allowed.test:9443",
        "header": "x-api-key",
        "format": "{key}",
        "secret": "anthropic",
        "paths": ["POST /v1/messages"],  # not a known route: its paths are given
    }
    gw_down = env.gateway(routes={**_routes(env), "down": down})
    status, out = _post(env, f"{gw_down.routes}/down/v1/messages", ANTHROPIC_BODY)
    assert status == "502", out
    line = gw_down.last(route="down")
    assert line["status"] == 502 and line["reason"].startswith("upstream:"), line

    status, out = _post(env, f"{gw.routes}/nosuchroute/v1/messages", ANTHROPIC_BODY)
    assert status == "404" and "unknown route" in out
    line = gw.last(reason="unknown route")
    assert line["allowed"] is False and line["status"] == 404 and line["route"] is None
    assert line["path"] == "/nosuchroute/v1/messages"
    assert len(env.ups.requests("model.test")) >= 4


def test_the_real_key_goes_only_to_an_upstream_whose_certificate_verifies(env: Env) -> None:
    # Allowed: the route's upstream verified against the configured CA (the test CA).
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "verified"}}])
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "verified" in out
    # The same route when the gateway trusts only the system bundle: the upstream's certificate
    # does not verify, the request (and its key) is never sent, the engine gets 502.
    before = len(env.ups.requests("model.test"))
    gw = env.gateway(routes=_routes(env), upstream_ca=None)
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "502", out
    assert len(env.ups.requests("model.test")) == before
    line = gw.last(route="anthropic")
    assert line["status"] == 502 and "certificate" in line["reason"].lower(), line


def test_budgets_let_requests_under_them_pass_and_answer_429_past_them(env: Env) -> None:
    gw = env.gateway(routes=_routes(env), budget={"max_requests": 2, "max_tokens": None})
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": f"r{i}"}} for i in range(3)])
    before = len(env.ups.requests("model.test"))
    assert [_post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] for _ in range(2)] == [
        "200",
        "200",
    ]
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "429"
    body = json.loads(out.split("\r\n\r\n", 1)[1])
    assert body["error"]["budget"] == "max_requests" and body["error"]["limit"] == 2
    line = gw.log()[-1]
    assert line["budget"] == "max_requests" and line["allowed"] is False and line["status"] == 429
    assert len(env.ups.requests("model.test")) == before + 2  # the third never left

    # Tokens: 15 per reply (10 in, 5 out); a budget of 25 lets two through, refuses the third.
    gw = env.gateway(routes=_routes(env), budget={"max_requests": None, "max_tokens": 25})
    env.ups.set_script(
        [
            {
                "protocol": "anthropic",
                "reply": {"text": f"t{i}"},
                "usage": {"input_tokens": 10, "output_tokens": 5},
            }
            for i in range(3)
        ]
    )
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", {**ANTHROPIC_BODY, "stream": True})[0] == "200"
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "429" and '"budget": "max_tokens"' in out
    assert [e["budget"] for e in gw.log()] == [None, None, "max_tokens"]


# ---------------------------------------------------------------- the log and the container


def test_out_counts_the_request_line_headers_and_body_the_upstream_received(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 80, "methods": ["GET", "POST"]}],
        allow_private=_private(env),
        routes=_routes(env),
    )
    sent = [
        ("GET", "", "http://allowed.test/a?b=c"),
        ("POST", "-d x=12345 -H 'X-Pad: padding'", "http://allowed.test/form"),
        ("POST", "-H 'Transfer-Encoding: chunked' -d hello", "http://allowed.test/chunked"),
        ("GET", "--http2-prior-knowledge", "http://allowed.test/h2"),  # goes out as HTTP/1.1
    ]
    for method, extra, url in sent:
        env.ups.clear_requests("allowed.test")
        code, out, err = env.sh(f"{CURL} -x {gw.proxy} -X {method} {extra} {url}")
        assert code == 0 and out.strip() == "hello from allowed.test", (url, err)
        (got,) = env.ups.requests("allowed.test")
        line = gw.last(method=method, host="allowed.test")
        assert got["wire_bytes"] > got["body_bytes"] + len(f"{method} / HTTP/1.1\r\n")
        assert line["bytes_out"] == got["wire_bytes"], (url, line, got)
    # A route call: what reached the model server, the real key in its headers included.
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "x"}}])
    env.ups.clear_requests()
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    (got,) = env.ups.requests()
    assert got["headers"]["x-api-key"] == REAL_KEY
    assert gw.last(door="route", status=200)["bytes_out"] == got["wire_bytes"]
    # A refused request: nothing left.
    assert (
        env.sh(f"{CURL} -o /dev/null -w '%{{http_code}}' -x {gw.proxy} -d x=1 http://denied.test/")[1]
        == "403"
    )
    assert gw.last(host="denied.test")["bytes_out"] == 0


def test_the_log_has_one_line_per_decision_with_every_field(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}],
        allow_private=_private(env),
        routes=_routes(env),
    )
    assert (gw.log_dir / "ready").is_file()
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "x"}}])
    env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/ https://denied.test/")
    _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    _post(env, f"{gw.routes}/nope/x", ANTHROPIC_BODY)
    time.sleep(0.3)
    lines = gw.log()
    assert len(lines) == 4, lines
    for e in lines:
        assert set(e) == FIELDS, e
        assert e["t"].endswith("Z") and e["door"] in ("proxy", "route")
        assert isinstance(e["bytes_in"], int) and isinstance(e["bytes_out"], int)
    assert sorted((e["door"], e["allowed"]) for e in lines) == [
        ("proxy", False),
        ("proxy", True),
        ("route", False),
        ("route", True),
    ]


def test_only_clients_on_the_job_network_may_use_the_gateway(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    # The same request from the other side (a container on the egress network, like another
    # job's gateway reached through a broad allow_private): closed, for both doors.
    res = env.ups.run(
        f"{CURL} -x http://{gw.egress_ip}:3128 https://allowed.test/; echo rc=$?;"
        f" {CURL} http://{gw.egress_ip}:8080/anthropic/v1/messages -d x=1; echo rc=$?"
    )
    assert res.stdout.count("rc=0") == 0 and "hello from" not in res.stdout, res
    reasons = [e["reason"] for e in gw.log() if not e["allowed"]]
    assert len([r for r in reasons if r and r.endswith("not on the job network")]) == 2, reasons


def test_the_gateway_runs_hardened_and_still_works(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    cfg = gw.container.attrs
    assert cfg["Config"]["User"] == "65534:65534"
    assert cfg["HostConfig"]["ReadonlyRootfs"] is True
    assert cfg["HostConfig"]["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in cfg["HostConfig"]["SecurityOpt"]
    code, (out, err) = gw.container.exec_run(
        ["sh", "-c", "id -u; grep -E '^(Uid|CapEff)' /proc/1/status; touch /x"], demux=True
    )
    text = out.decode()
    assert text.splitlines()[0] == "65534"
    assert "CapEff:\t0000000000000000" in text
    assert "Read-only file system" in err.decode()


def test_a_bad_config_or_missing_secret_stops_the_gateway_before_it_listens(env: Env) -> None:
    # Allowed counterpart: the same routes with the secret present start (every test above).
    gw = env.gateway(routes=_routes(env))
    assert (gw.log_dir / "ready").exists()
    (gw.log_dir.parent / "secrets" / "anthropic").unlink()
    name = f"{gw.container.name}-again"
    c = env.docker.containers.run(
        GATEWAY_IMAGE,
        name=name,
        detach=True,
        network=env.job_net,
        user="65534:65534",
        read_only=True,
        cap_drop=["ALL"],
        tmpfs={"/tmp": "rw,size=64m"},
        labels=_labels(env.session),
        volumes={
            str(gw.log_dir.parent / "config.json"): {"bind": "/etc/fila-gateway/config.json", "mode": "ro"},
            str(gw.log_dir.parent / "secrets"): {"bind": "/run/fila-gateway/secrets", "mode": "ro"},
            str(env.ups.ca_file): {"bind": "/etc/fila-gateway/upstream-ca.pem", "mode": "ro"},
        },
    )
    result = c.wait(timeout=60)
    logs = c.logs().decode(errors="replace")
    assert result["StatusCode"] != 0
    assert "routes.anthropic: cannot read the secret" in logs, logs

    # An allow entry that is an IP literal: refused at start, naming the entry.
    cfg_dir = env.tmp / f"{name}-cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(
        json.dumps({"allow": [{"host": env.ups.ip("allowed.test"), "port": 443}]})
    )
    (cfg_dir / "config.json").chmod(0o644)
    c = env.docker.containers.run(
        GATEWAY_IMAGE,
        name=f"{name}-ip",
        detach=True,
        network=env.job_net,
        user="65534:65534",
        read_only=True,
        cap_drop=["ALL"],
        tmpfs={"/tmp": "rw,size=64m"},
        labels=_labels(env.session),
        volumes={str(cfg_dir / "config.json"): {"bind": "/etc/fila-gateway/config.json", "mode": "ro"}},
    )
    assert c.wait(timeout=60)["StatusCode"] != 0
    assert "allow[0].host" in c.logs().decode(errors="replace") and "is not a DNS name" in c.logs().decode()


# ---------------------------------------------------------------- relays and bypasses

# A relay inside the engine: CONNECT through the gateway, then pass the
# client's TLS on with its first bytes altered ("v4": record version 03 04; "empty": an empty
# handshake record first; "none": untouched).
RELAY = r"""
import socket, sys
gw, mode, target = sys.argv[1], sys.argv[2], sys.argv[3]
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", 9000)); ls.listen(1)
c, _ = ls.accept()
u = socket.create_connection((gw, 3128))
u.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
h = b""
while b"\r\n\r\n" not in h:
    h += u.recv(1)
first = c.recv(65536)
if mode == "v4":
    first = first[:2] + b"\x04" + first[3:]
elif mode == "empty":
    first = b"\x16\x03\x01\x00\x00" + first
u.sendall(first)
import threading
def pipe(a, b):
    try:
        while (d := a.recv(65536)):
            b.sendall(d)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
threading.Thread(target=pipe, args=(u, c), daemon=True).start()
pipe(c, u)
"""


def test_a_tunnel_whose_first_bytes_are_not_a_clean_client_hello_is_closed(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 443, "methods": None}], allow_private=_private(env)
    )

    def through(mode: str, sni: str) -> str:
        relay = f"timeout 15 python3 -c {shlex.quote(RELAY)} {gw.ip} {mode} allowed.test:443"
        curl = f"curl -sS -k --max-time 10 --resolve {sni}:9000:127.0.0.1 https://{sni}:9000/"
        return env.sh(f"{relay} & sleep 0.5; {curl}; echo rc=$?; wait")[1]

    # Allowed: the relay passes a clean handshake for the CONNECT host on.
    assert "hello from allowed.test" in through("none", "allowed.test")
    # The same relay with the record version or an empty record first, carrying a handshake for
    # another name (domain fronting past the server-name check): closed, logged, never served.
    for mode, why in (("v4", "unknown TLS record version"), ("empty", "bad TLS record length")):
        before = len(env.ups.requests("allowed.test"))
        out = through(mode, "denied.test")
        assert "hello from" not in out and "rc=0" not in out, out
        line = gw.last(method="CONNECT", allowed=False, reason=f"tunnel closed: {why}")
        assert line["host"] == "allowed.test" and line["port"] == 443
        assert len(env.ups.requests("allowed.test")) == before


def test_a_method_limited_entry_is_plain_http_only_and_connect_to_it_is_refused(env: Env) -> None:
    gw = env.gateway(
        allow=[
            {"host": "allowed.test", "port": 80, "methods": ["GET"]},
            {"host": "allowed.test", "port": 443, "methods": ["GET", "HEAD"]},
        ],
        allow_private=_private(env),
    )
    env.ups.clear_requests("allowed.test")
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} http://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    # CONNECT to a method-limited entry would hide the method (and the Host header) in a tunnel.
    out = raw_connect(env, gw, "allowed.test:80", then="POST / HTTP/1.1\r\nHost: denied.test\r\n\r\n")
    assert " 405" in out.splitlines()[0] and "INNER" not in out, out
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} -X DELETE https://allowed.test/x")
    assert code != 0 and "405" in err, err
    line = gw.last(method="CONNECT", port=443)
    assert line["allowed"] is False and line["reason"] == "method-limited entry: plain HTTP only, no CONNECT"
    assert [r["method"] for r in env.ups.requests("allowed.test")] == ["GET"]


def test_usage_is_read_only_from_model_calls_and_never_negative(env: Env) -> None:
    # A route whose paths also open a Files-API-like store: a body the engine uploads comes back
    # from the model API's host, but it is no usage report.
    routes = _routes(env)
    routes["openai"]["paths"] = [
        "POST /v1/chat/completions",
        "POST /v1/files",
        "GET /v1/files/*/content",
    ]
    gw = env.gateway(routes=routes, budget={"max_requests": None, "max_tokens": 1000})
    step = {"protocol": "openai", "reply": {"text": "ok"}, "usage": {"input_tokens": 300, "output_tokens": 0}}
    env.ups.set_script([step] * 6)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _post(env, f"{gw.routes}/openai/chat/completions", chat)[0] == "200"
    forged = {"usage": {"input_tokens": -1_000_000_000, "prompt_tokens": -5}}
    status, out = _post(env, f"{gw.routes}/openai/files", forged)
    assert status == "200", out
    fid = json.loads(out.split("\r\n\r\n", 1)[1])["id"]
    code, out, err = env.sh(f"{CURL} -i {gw.routes}/openai/files/{fid}/content")
    assert code == 0 and " 200" in out.splitlines()[0] and "-1000000000" in out, err
    got = gw.last(path=f"/files/{fid}/content")
    assert got["status"] == 200 and got["usage"] is None
    # 300 tokens a call against 1000: the fourth call is past the budget (the forgery gave nothing back).
    assert [_post(env, f"{gw.routes}/openai/chat/completions", chat)[0] for _ in range(4)] == [
        "200",
        "200",
        "200",
        "429",
    ]


def test_a_route_refuses_protocol_upgrades(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.clear_requests("model.test")
    code, out, err = env.sh(f"{CURL} -i {gw.routes}/anthropic/v1/models")
    assert code == 0 and "no API at GET /v1/models" in out, err  # reached the upstream
    ws = "-H 'Connection: Upgrade' -H 'Upgrade: websocket' -H 'Sec-WebSocket-Version: 13'"
    ws += " -H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=='"
    code, out, err = env.sh(f"{CURL} -i {ws} {gw.routes}/anthropic/v1/models")
    assert code == 0 and " 403" in out.splitlines()[0] and "protocol upgrade on a route" in out, out
    assert len(env.ups.requests("model.test")) == 1
    assert gw.last(reason="protocol upgrade on a route")["allowed"] is False


def test_a_token_budget_admits_one_model_call_at_a_time_and_unknown_usage_spends_it(env: Env) -> None:
    gw = env.gateway(routes=_routes(env), budget={"max_requests": None, "max_tokens": 100})
    big = {"protocol": "anthropic", "hang": 1, "reply": {"text": "x"},
           "usage": {"input_tokens": 1000, "output_tokens": 1000}}  # fmt: skip
    env.ups.set_script([big] * 6)
    env.ups.clear_requests("model.test")
    body = shlex.quote(json.dumps(ANTHROPIC_BODY))
    one = (
        f"{CURL} -o /dev/null -w '%{{http_code}}\\n' -H 'content-type: application/json' --data-binary {body}"
    )
    code, out, err = env.sh(
        " & ".join([f"{one} {gw.routes}/anthropic/v1/messages"] * 5) + "; wait", timeout=60
    )
    assert code == 0, err
    # Five parallel calls of 2,000 tokens under a budget of 100: one passes, four wait their turn
    # and are refused (not all five sent while the first one's usage was unknown).
    assert sorted(out.split()) == ["200", "429", "429", "429", "429"], out
    assert len(env.ups.requests("model.test")) == 1

    # An OpenAI chat stream sends usage only when asked: the gateway asks.
    gw = env.gateway(routes=_routes(env), budget={"max_requests": None, "max_tokens": 1000})
    chat = {"protocol": "openai", "stream_usage": "when_asked", "reply": {"text": "c"},
            "usage": {"input_tokens": 20, "output_tokens": 4}}  # fmt: skip
    env.ups.set_script([chat, {"protocol": "anthropic", "malformed": "json"}, chat])
    stream = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(env, f"{gw.routes}/openai/chat/completions", stream)[0] == "200"
    assert env.ups.requests("model.test")[-1]["body"].count('"include_usage": true') == 1
    assert gw.last(route="openai", status=200)["usage"] == {"input_tokens": 20, "output_tokens": 4}
    # A model call that answers without usage the gateway can read: unknown cost, it spends the
    # budget (the record says the budget ended the run), and the next call is refused.
    status, _ = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200"
    line = gw.last(route="anthropic", status=200)
    assert line["budget"] == "max_tokens" and line["reason"].startswith("no readable usage"), line
    assert _post(env, f"{gw.routes}/openai/chat/completions", stream)[0] == "429"


def test_a_route_reaches_only_the_model_calls_of_its_api(env: Env) -> None:
    routes = _routes(env)
    routes["gemini"] = {**routes["anthropic"], "header": "x-goog-api-key"}
    gw = env.gateway(routes=routes)
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}])
    env.ups.clear_requests("model.test")
    assert _post(env, f"{gw.routes}/anthropic/v1/messages?beta=true", ANTHROPIC_BODY)[0] == "200"
    url = f"{gw.routes}/gemini/v1beta/models/gemini-2.5-pro:countTokens"
    code, out, err = env.sh(f"{CURL} -i {url} -d '{{}}'")
    assert code == 0 and " 403" not in out.splitlines()[0], (out, err)  # reached the upstream
    reached = len(env.ups.requests("model.test"))
    assert reached == 2
    _refused_before_upstream(env, gw, reached, (
        ("DELETE", "/anthropic/v1/files/file-1", "403"),
        ("GET", "/anthropic/v1/messages/batches", "403"),
        ("POST", "/openai/fine_tuning/jobs", "403"),
        ("GET", "/openai/files/file-1/content", "403"),
        ("POST", "/gemini/v1beta/models/g:generateContent/../../files", "400"),
        ("POST", "/anthropic/v1/messages/..;/files", "400"),
        ("POST", "/anthropic/v1/messages%2F..%2Ffiles", "400"),
        ("POST", "/anthropic/v1/%252e%252e/files", "400"),
        ("POST", "/anthropic/v1\\messages", "400"),
    ))  # fmt: skip


def _refused_before_upstream(env: Env, gw: Any, reached: int, cases: Any) -> None:
    """Each (method, path, status) answered `status` by the gateway, and none reached model.test
    (which had `reached` requests before)."""
    for method, path, status in cases:
        code, out, _ = env.sh(f"{CURL} -i --path-as-is -X {method} -d '{{}}' '{gw.routes}{path}'")
        assert code == 0 and f" {status}" in out.splitlines()[0], (method, path, out)
    assert len(env.ups.requests("model.test")) == reached  # none of them left the gateway


def test_a_setup_routes_last_double_star_reaches_deep_registry_paths_and_nothing_else(env: Env) -> None:
    """A setup route (docs/environments.md, "Secrets for the setup"): `GET /v1/**` reaches any
    path below /v1 of its upstream, `%2F` included (npm's scoped names); another method, another
    prefix, or a dot segment once `%2F` is read as a slash is refused before the upstream."""
    routes = {"corp": {**_routes(env)["anthropic"], "paths": ["GET /v1/**"]}}
    gw = env.gateway(routes=routes)
    env.ups.clear_requests("model.test")
    for path in ("/corp/v1/models", "/corp/v1/a/b/@scope%2Fpkg", "/corp/v1/pkg/-/pkg-1.0.0+local.tgz"):
        code, out, err = env.sh(f"{CURL} -i --path-as-is '{gw.routes}{path}'")
        assert code == 0 and out.split()[1] not in ("400", "403"), (path, out, err)  # reached it
    reached = len(env.ups.requests("model.test"))
    assert reached == 3
    _refused_before_upstream(env, gw, reached, (
        ("POST", "/corp/v1/models", "403"),
        ("GET", "/corp/v2/models", "403"),
        ("GET", "/corp/v1", "403"),
        ("GET", "/corp/v1/a%2F..%2F..%2Fv2", "400"),
        ("GET", "/corp/v1/a%2e%2e/b", "400"),
        ("GET", "/corp/v1/a;b", "400"),
    ))  # fmt: skip


def test_a_huge_request_head_is_refused_and_in_flight_calls_keep_their_usage(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script(
        [{"protocol": "anthropic", "hang": 4, "reply": {"text": "slow"},
          "usage": {"input_tokens": 5000, "output_tokens": 5000}}]
    )  # fmt: skip
    bomb = (
        "import socket,sys\n"
        f"s=socket.create_connection(({gw.ip!r},8080),timeout=30)\n"
        "s.sendall(b'GET /anthropic/v1/models HTTP/1.1\\r\\nHost: x\\r\\nX-A: ')\n"
        "sent=0\n"
        "try:\n"
        "    for i in range(200):\n"
        "        s.sendall(b'a'*(1<<20)); sent+=1\n"
        "except OSError as e: pass\n"
        "print('sent MiB', sent)\n"
        "try: print('GOT', s.recv(200))\n"
        "except OSError as e: print('GOT', e)\n"
    )
    body = shlex.quote(json.dumps(ANTHROPIC_BODY))
    call = (
        f"{CURL} -H 'content-type: application/json' --data-binary {body} {gw.routes}/anthropic/v1/messages"
    )
    _, out, err = env.sh(
        f"{call} > /tmp/call.out & sleep 1.5; python3 -c {shlex.quote(bomb)}; wait; cat /tmp/call.out",
        timeout=60,
    )
    assert "slow" in out, (out, err)  # the model call in flight finished and was answered
    sent = int(out.split("sent MiB ", 1)[1].split()[0])
    assert sent < 200 and "431" in out, out  # the gateway stopped reading well before 200 MiB
    gw.container.reload()
    assert gw.container.status == "running"
    lines = [e for e in gw.raw_log() if e["door"] == "route"]
    # The call's line was written as it was sent (in flight), then again with its usage.
    assert [(e["reason"], e["usage"]) for e in lines if e["id"] == lines[0]["id"]] == [
        ("in flight", None),
        (None, {"input_tokens": 5000, "output_tokens": 5000}),
    ]


def test_the_log_is_capped_and_the_summary_keeps_the_usage(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 80, "methods": None}],
        allow_private=_private(env),
        routes=_routes(env),
        environment={"FILA_GATEWAY_LOG_CAP": str(64 * 1024)},
    )
    env.ups.set_script(
        [
            {
                "protocol": "anthropic",
                "reply": {"text": "t"},
                "usage": {"input_tokens": 9000, "output_tokens": 1000},
            }
        ]
        * 2
    )
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    flood = (
        "import socket\n"
        "req=('GET http://denied.test/'+'p'*20000+' HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n').encode()\n"
        "for i in range(400):\n"
        f"    s=socket.create_connection(({gw.ip!r},3128)); s.sendall(req); b=b''\n"
        "    while b'\\r\\n\\r\\n' not in b: b+=s.recv(65536)\n"
        "    s.close()\n"
    )
    code, _, err = env.sh(f"python3 -c {shlex.quote(flood)}", timeout=120)
    assert code == 0, err
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    gw.summary()  # every call ended and its totals written
    log = gw.log_dir / "egress.jsonl"
    assert log.stat().st_size <= 64 * 1024 + 16 * 1024  # the cap (route lines get a last margin)
    assert all(len(e["path"] or "") <= 260 and len(e["host"] or "") <= 260 for e in gw.log())
    from fila.egress import config as egress

    rec = egress.read_log(log, summary=gw.log_dir / "summary.json")
    assert rec.routes["anthropic"].input_tokens == 18000 and rec.routes["anthropic"].output_tokens == 2000
    assert rec.denied == 400 and rec.allowed == 2 and rec.dropped > 0
    summary = gw.summary()
    assert summary["suppressed"] and summary["tokens"] == 20000


def test_a_route_body_past_the_limit_is_refused_and_frees_the_budget_slot(env: Env) -> None:
    gw = env.gateway(routes=_routes(env), budget={"max_requests": None, "max_tokens": 100_000})
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": f"r{i}"}} for i in range(2)])
    env.ups.clear_requests("model.test")
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    # 40 MiB in chunks (no Content-Length to refuse it up front): mitmproxy's body_size_limit.
    big = (
        "import socket\n"
        f"s=socket.create_connection(({gw.ip!r},8080),timeout=20)\n"
        "s.sendall(b'POST /anthropic/v1/messages HTTP/1.1\\r\\nHost: x\\r\\n"
        "Content-Type: application/json\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n')\n"
        "chunk=b'a'*(1<<20)\n"
        "try:\n"
        "    for i in range(40):\n"
        "        s.sendall(b'%x\\r\\n' % len(chunk) + chunk + b'\\r\\n')\n"
        "    s.sendall(b'0\\r\\n\\r\\n')\n"
        "except OSError as e: print('send', e)\n"
        "try: print('GOT', s.recv(100))\n"
        "except OSError as e: print('GOT', e)\n"
    )
    code, out, err = env.sh(f"python3 -c {shlex.quote(big)}", timeout=60)
    assert code == 0 and "GOT b'HTTP/1.1 413" in out, (out, err)
    # The refused call gave the one-at-a-time slot back: the next call is served.
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "r1" in out, out
    assert len(env.ups.requests("model.test")) == 2


def test_an_address_of_the_gateways_host_is_refused_unless_allow_private_names_it(env: Env) -> None:
    ip = env.ups.ip("allowed.test")  # stands in for the host: a listed name resolving to it
    allow = [{"host": "allowed.test", "port": 443, "methods": None}]
    gw = env.gateway(allow=allow, allow_private=_private(env))
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err
    # The same name when its address is one of the host's: refused, also inside allow_private.
    gw = env.gateway(allow=allow, allow_private=_private(env), host_addresses=[ip])
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code != 0 and "403" in err, err
    assert gw.last(method="CONNECT")["reason"] == f"address of the gateway's host {ip}"
    # Named on its own in allow_private (a mirror on the host, on purpose): allowed.
    gw = env.gateway(allow=allow, allow_private=[f"{ip}/32"], host_addresses=[ip])
    code, out, err = env.sh(f"{CURL} -x {gw.proxy} https://allowed.test/")
    assert code == 0 and out.strip() == "hello from allowed.test", err


# ---------------------------------------------------------------- what comes back through a route


def _key_forms(key: str) -> dict[str, str]:
    """The forms of `key` an engine could decode: as is, percent-encoded (both cases, once or
    twice), JSON escapes (both cases), hex (both cases), HTML character references, and its base64
    (standard and urlsafe) at each of the three alignments it can have inside a longer text."""
    forms = {
        "plain": key,
        "url": "".join(f"%{ord(c):02X}" for c in key),
        "url-lower": "".join(f"%{ord(c):02x}" for c in key),
        "url-twice": "".join(f"%25{ord(c):02X}" for c in key),
        "json": "".join(f"\\u{ord(c):04x}" for c in key),
        "json-upper": "".join(f"\\u{ord(c):04X}" for c in key),
        "hex": key.encode().hex(),
        "hex-upper": key.encode().hex().upper(),
        "html": "".join(f"&#{ord(c)};" for c in key),
    }
    for a in range(3):
        whole = key[a:][: (len(key) - a) // 3 * 3].encode()
        forms[f"base64+{a}"] = base64.b64encode(whole).decode()
        forms[f"base64url+{a}"] = base64.urlsafe_b64encode(whole).decode()
    return forms


def _leaks(out: str, *keys: str) -> list[str]:
    """Every form of a key in what the engine received, also once URL- and JSON-decoded."""
    decoded = [
        out,
        urllib.parse.unquote(out),
        re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m[1], 16)), out),
        html.unescape(out),
        re.sub(r"\r|\n|\\r|\\n| ", "", out),  # base64 wrapped in lines or broken by spaces
        re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m[1], 16)), out),  # JS/Python escapes
    ]
    return [name for key in keys for name, f in _key_forms(key).items() for text in decoded if f in text]


def _sse_text(out: str) -> str:
    """The text an engine assembles from an Anthropic stream's text deltas."""
    text = ""
    for line in out.splitlines():
        if line.startswith("data: {") and '"text_delta"' in line:
            text += json.loads(line[6:])["delta"]["text"]
    return text


@pytest.mark.quick
def test_a_route_upstream_echoing_the_credential_never_shows_it_to_the_engine_in_any_form(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    usage = {"input_tokens": 3, "output_tokens": 2}
    forms = {  # what the upstream's echo comes as -> what the gateway replaced, per kind
        "plain": {"status": 1, "header": 1, "body": 1},
        "chunked": {"body": 1},
        "sse": {"body": 1, "body:split": 1},
        "gzip": {"refused:compressed": 1},
        "base64": {"body:base64": 6},
        "urlencoded": {"body": 1, "body:url": 2},
        "json-escaped": {"body:json": 2},
        "hex": {"body:hex": 2},
        "html": {"body:html": 2},
        "html-loose": {"body:html": 2},
        "js-hex": {"body:json": 2},
        "base64-spaced": {"body:base64": 2},
        "percent-twice": {"body:url": 1},
        "base64-lines": {"body:base64": 2},
    }
    env.ups.set_script(
        [
            {
                "protocol": "anthropic",
                "reply": {"text": "normal"},
                "usage": {"input_tokens": 12, "output_tokens": 7},
            }
        ]
        + [{"protocol": "anthropic", "reflect": f, "usage": usage} for f in forms]
        + [{"protocol": "openai", "reflect": "plain"}]
    )
    env.ups.clear_requests("model.test")
    # Allowed: a normal model call, answered and metered, nothing scrubbed.
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "normal" in out
    line = gw.last(route="anthropic", status=200)
    assert line["usage"] == {"input_tokens": 12, "output_tokens": 7} and line["scrubbed"] is None

    for form, kinds in forms.items():
        body = {**ANTHROPIC_BODY, "stream": True} if form == "sse" else ANTHROPIC_BODY
        status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", body)
        assert _leaks(out, REAL_KEY) == [], (form, out)
        line = gw.final()
        assert line["route"] == "anthropic" and line["scrubbed"] == kinds, (form, line)
        if form == "gzip":
            assert status == "502" and "compressed" in out and line["allowed"] is True, out
        else:
            assert status == "200" and "fila-scrubbed" in out, (form, out)
        if form == "sse":
            text = _sse_text(out)  # streamed on, metered, the key gone from the joined text
            assert text.startswith("the key is ") and REAL_KEY[:8] not in text, text
            assert line["usage"] == usage
    status, out = _post(env, f"{gw.routes}/openai/chat/completions", {"model": "m", "messages": []})
    assert status == "200" and _leaks(out, REAL_OPENAI_KEY) == [] and "Bearer fila-scrubbed" in out, out
    # The upstream did receive the real key every time (what it echoed was the real thing).
    reqs = env.ups.requests("model.test")
    assert [r["headers"].get("x-api-key") for r in reqs[:-1]] == [REAL_KEY] * (len(forms) + 1)

    summary = gw.summary()
    totals: dict[str, int] = {}
    for kinds in forms.values():
        for k, n in kinds.items():
            totals[k] = totals.get(k, 0) + n
    assert summary["routes"]["anthropic"]["scrubbed"] == totals
    assert summary["routes"]["openai"]["scrubbed"] == {"status": 1, "header": 1, "body": 1}
    log_text = (gw.log_dir / "egress.jsonl").read_text()
    assert REAL_KEY not in log_text and REAL_OPENAI_KEY not in log_text

    from fila.egress import config as egress

    rec = egress.read_log(gw.log_dir / "egress.jsonl", summary=gw.log_dir / "summary.json")
    assert rec.routes["anthropic"].scrubbed == totals
    warned = egress.scrub_messages(rec)
    echoed = sum(n for k, n in totals.items() if not k.startswith("refused"))
    assert any(
        f"the upstream of route anthropic echoed the injected credential {echoed} times" in w for w in warned
    ), warned
    assert any("route anthropic sent 1 compressed answers" in w for w in warned), warned
    assert any("route openai echoed the injected credential 3 times" in w for w in warned), warned


def test_a_route_name_the_engine_invents_is_a_denied_request_and_never_a_route(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}] * 2)
    env.ups.clear_requests("model.test")
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "ok" in out
    invented = [
        "anthropic\\..\\openai",
        "v1",
        "anthropic@host:80",
        "Anthropic",
        "anthropic%2f..",
    ]
    for name in invented:
        code, out, _ = env.sh(
            f"{CURL} -i --path-as-is -d '{{}}' {shlex.quote(f'{gw.routes}/{name}/v1/messages')}"
        )
        assert code == 0 and " 404" in out.splitlines()[0] and "unknown route" in out, (name, out)
        line = gw.log()[-1]
        assert line["allowed"] is False and line["route"] is None and line["reason"] == "unknown route"
        assert line["path"].isascii() and line["path"].isprintable(), line  # cut and escaped
    # Bytes curl would encode, sent raw: a non-ASCII name with a control character.
    raw = (
        "import socket\n"
        f"s=socket.create_connection(({gw.ip!r},8080),timeout=10)\n"
        "s.sendall(b'POST /opena\\xc3\\xa9i\\x7f/v1/messages HTTP/1.1\\r\\n'\n"
        "          b'Host: x\\r\\nContent-Length: 0\\r\\n\\r\\n')\n"
        "print(s.recv(100).split(b'\\r\\n')[0].decode())\n"
    )
    code, out, err = env.sh(f"python3 -c {shlex.quote(raw)}")
    assert code == 0 and " 404" in out, (out, err)
    invented.append("opena\u00e9i\x7f")
    line = gw.final()
    assert line["route"] is None and line["path"] == "/opena\\xe9i\\x7f/v1/messages", line
    assert (
        _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    )  # rewrites the summary
    assert len(env.ups.requests("model.test")) == 2
    summary = gw.summary()
    assert list(summary["routes"]) == ["anthropic"] and summary["denied"] == len(invented)
    from fila.egress import config as egress

    rec = egress.read_log(gw.log_dir / "egress.jsonl")  # from the log alone, too
    assert list(rec.routes) == ["anthropic"] and rec.denied == len(invented) and rec.allowed == 2


def test_requests_the_proxy_refuses_before_the_addon_are_logged_as_denied_not_as_a_502(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}] * 2)
    env.ups.clear_requests("model.test")
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    head = "POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = {
        # request smuggling: both framings
        "smuggled": (head + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "400"),
        "bad length": (head + "Content-Length: 5x\r\n\r\n{}", "400"),
        "huge head": (head + "X-Pad: " + "a" * 70000, "431"),
        # header lines mitmproxy cannot parse: refused before any hook sees the request
        "no colon": (head + "NoColonHere\r\nContent-Length: 0\r\n\r\n", "400"),
        "folded": ("POST /anthropic/v1/messages HTTP/1.1\r\n Host: x\r\nContent-Length: 0\r\n\r\n", "400"),
        "empty name": (head + ": v\r\n\r\n", "400"),
    }
    for name, (raw, want) in cases.items():
        script = (
            "import socket\n"
            f"s=socket.create_connection(({gw.ip!r},8080),timeout=10)\n"
            f"s.sendall({raw.encode()!r})\n"
            "print(s.recv(200).split(b'\\r\\n')[0].decode())\n"
        )
        code, out, err = env.sh(f"python3 -c {shlex.quote(script)}")
        assert code == 0 and f" {want}" in out, (name, out, err)
        time.sleep(0.2)
        line = gw.raw_log()[-1]
        assert line["allowed"] is False and line["status"] == int(want), (name, line)
        why = "request headers larger than" if want == "431" else "refused by the proxy: "
        if name in ("no colon", "folded", "empty name"):
            why = "malformed request: Invalid header"
            assert line["door"] == "route", line
        assert line["reason"].startswith(why), (name, line)
    assert not any(e["allowed"] and e["status"] == 502 for e in gw.log())
    assert len(env.ups.requests("model.test")) == 1  # none of them reached the upstream
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    # The refused requests gave back the budget count and the in-flight count.
    summary = gw.summary()
    assert summary["requests"] == 2 and summary["in_flight"] == 0 and summary["denied"] == len(cases)


SERVER_FIRST = r"""
import socket, ssl, sys
gw, target, send = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.create_connection((gw, 3128), timeout=8)
s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(4096)
print("STATUS", head.split(b"\r\n")[0].decode())
early = head.split(b"\r\n\r\n", 1)[1]
s.settimeout(1.0)
try:
    early += s.recv(4096)
except TimeoutError:
    pass
print("BEFORE", early)
if send.startswith("tls:"):
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    ctx = ssl.create_default_context()
    ctx.check_hostname = bool(send[4:])  # "tls:" alone: a ClientHello that names no server
    tls = ctx.wrap_bio(inc, out, server_hostname=send[4:] or None)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    data = out.read()
else:
    data = send.encode()
s.sendall(data)
s.settimeout(5)
got = b""
try:
    while d := s.recv(4096):
        got += d
except OSError:
    pass
print("AFTER", got)
"""


def test_a_tunnel_whose_server_speaks_first_is_checked_against_the_clients_first_bytes(env: Env) -> None:
    gw = env.gateway(
        allow=[{"host": "allowed.test", "port": 2222, "methods": None}], allow_private=_private(env)
    )

    def tunnel(send: str) -> str:
        cmd = f"python3 -c {shlex.quote(SERVER_FIRST)} {gw.ip} allowed.test:2222 {shlex.quote(send)}"
        code, out, err = env.sh(cmd)
        assert code == 0 and "STATUS HTTP/1.1 200" in out, (out, err)
        return out

    # Allowed: the server's banner waits until the client's first bytes, a ClientHello for the
    # CONNECT host, are checked; then the tunnel carries both ways.
    out = tunnel("tls:allowed.test")
    assert "BEFORE b''" in out and "SSH-2.0-fila-test-banner" in out.split("AFTER", 1)[1], out
    assert "got " in out
    # Plain bytes, or a ClientHello for another name: closed, and the banner never reaches the client.
    for send, reason in (
        ("GET / HTTP/1.1\r\nHost: denied.test\r\n\r\n", "tunnel closed: not a TLS handshake"),
        ("tls:denied.test", "tls server name denied.test is not the CONNECT host"),
        ("tls:", "tls ClientHello without a server name"),
    ):
        out = tunnel(send)
        assert "BEFORE b''" in out and "AFTER b''" in out, out
        line = gw.last(method="CONNECT", allowed=False, reason=reason)
        assert line["host"] == "allowed.test" and line["port"] == 2222


# Everything that comes back, to the close; but a whole 200 answer ends the read: the gateway
# keeps that connection open for the next request, which only the socket's 8 s timeout would end.
# Any other answer (an interim one, a refusal) is read to the close.
RAW_POST = r"""
import re, socket, sys
ip, head = sys.argv[1], sys.argv[2].encode().decode("unicode_escape").encode("latin-1")
s = socket.create_connection((ip, 8080), timeout=8)
s.sendall(head)
out = b""
try:
    while d := s.recv(65536):
        out += d
        top, blank, body = out.partition(b"\r\n\r\n")
        size = re.search(rb"(?im)^content-length: *(\d+)\r?$", top)
        if top.startswith(b"HTTP/1.1 200 ") and blank and size and len(body) >= int(size[1]):
            break
except OSError as e:
    out += f"<{e}>".encode()
print(out.decode("latin-1"))
"""


def _raw_post(env: Env, gw: Gw, path: str, *headers: str, body: str = "{}") -> str:
    """A request sent byte for byte (`\\xNN` escapes for any byte): everything that comes back."""
    head = f"POST {path} HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
    head += "".join(f"{h}\\r\\n" for h in headers) + f"Content-Length: {len(body)}\\r\\n\\r\\n{body}"
    code, out, err = env.sh(f"python3 -c {shlex.quote(RAW_POST)} {gw.ip} {shlex.quote(head)}")
    assert code == 0, err
    return out


def test_an_upstream_answer_that_cannot_be_read_reaches_the_engine_as_the_gateways_502_without_its_bytes(
    env: Env,
) -> None:
    gw = env.gateway(routes=_routes(env))
    heads = {  # an upstream that echoes the key in a head mitmproxy cannot parse, then closes
        "cut head": "HTTP/1.1 200 OK\r\nX-Echo: {key}\r\n",
        "bad status": "HTTP/1.1 abc {key}\r\n\r\n",
        "no colon": "HTTP/1.1 200 OK\r\n{key}\r\n\r\n",
        "bad length": "HTTP/1.1 200 OK\r\nContent-Length: {key}\r\n\r\n",
    }
    env.ups.set_script(
        [{"protocol": "anthropic", "reply": {"text": "ok"}}]
        + [{"protocol": "anthropic", "reflect": "raw", "raw": [h], "pause": 0.3} for h in heads.values()]
    )
    env.ups.clear_requests("model.test")
    # Allowed: an answer that parses is passed on.
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "ok" in out
    for name in heads:
        status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
        assert status == "502" and "fila_gateway" in out and "no readable answer" in out, (name, out)
        assert _leaks(out, REAL_KEY) == [] and "mitmproxy" not in out, (name, out)
        line = gw.final()
        assert line["route"] == "anthropic" and line["status"] == 502 and line["allowed"] is True, line
        assert line["reason"].startswith("upstream: ") and REAL_KEY not in line["reason"], (name, line)
        assert len(line["reason"]) <= 256 + 3, line
    # The upstream did get the real key each time; the log never quotes it.
    assert [r["headers"]["x-api-key"] for r in env.ups.requests("model.test")] == [REAL_KEY] * 5
    assert REAL_KEY not in (gw.log_dir / "egress.jsonl").read_text()


def test_a_route_upstream_answering_101_gets_no_raw_pipe_to_the_engine(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    switch = "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: fila\r\n\r\n"
    env.ups.set_script(
        [
            {"protocol": "anthropic", "reply": {"text": "ok"}},
            {
                "protocol": "anthropic",
                "reflect": "raw",
                "raw": [switch, "raw after 101: {key}\n"],
                "pause": 0.3,
            },
            {"protocol": "anthropic", "reply": {"text": "ok again"}},
        ]
    )
    env.ups.clear_requests("model.test")
    out = _raw_post(env, gw, "/anthropic/v1/messages")
    assert out.startswith("HTTP/1.1 200") and "ok" in out, out
    out = _raw_post(env, gw, "/anthropic/v1/messages")
    assert "101" not in out and "raw after 101" not in out and _leaks(out, REAL_KEY) == [], out
    line = gw.final()
    assert line["route"] == "anthropic" and line["allowed"] is False and line["status"] is None, line
    assert line["reason"] == "route upstream answered 101 (no protocol switch on a route)", line
    # The next call is served as usual (the slot and the in-flight count were given back).
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "ok again" in out
    summary = gw.summary()
    assert summary["in_flight"] == 0 and summary["routes"]["anthropic"]["statuses"] == {"200": 2, "denied": 1}


TLS_TO_ROUTES = r"""
import socket, ssl, sys
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["h2", "http/1.1"])
try:
    s = ctx.wrap_socket(socket.create_connection((sys.argv[1], 8080), timeout=8), server_hostname="gateway")
    print("HANDSHAKE", s.selected_alpn_protocol())
except (OSError, ssl.SSLError) as e:
    print("REFUSED", type(e).__name__)
"""


def test_the_route_port_speaks_plain_http1_only_and_refuses_unsafe_bytes_before_forwarding(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}] * 3)
    env.ups.clear_requests("model.test")
    # Allowed: plain HTTP/1.1, an ordinary query and ordinary header values (spaces in them too).
    out = _raw_post(env, gw, "/anthropic/v1/messages?beta=true", "User-Agent: an engine/1.0 (linux)")
    assert out.startswith("HTTP/1.1 200") and "ok" in out, out
    assert env.ups.requests("model.test")[-1]["raw_query"] == "beta=true"
    # TLS (which would bring mitmproxy's own CA and HTTP/2) is closed at its first bytes.
    code, out, err = env.sh(f"python3 -c {shlex.quote(TLS_TO_ROUTES)} {gw.ip}")
    assert code == 0 and out.startswith("REFUSED"), (out, err)
    assert gw.last(reason="TLS on the route port (plain HTTP only)")["allowed"] is False
    # HTTP/2 without TLS (prior knowledge) is not spoken either.
    code, out, err = env.sh(
        f"curl -sS -m 10 --http2-prior-knowledge -d '{{}}' {gw.routes}/anthropic/v1/messages"
    )
    assert code != 0 or "ok" not in out, (out, err)
    # Bytes that the upstream's HTTP/1 parser could read as something else: 400, never forwarded.
    for path, headers, reason in (
        ("/anthropic/v1/messages?a=\\x01", (), "control character, space or non-ASCII in the path or query"),
        (
            "/anthropic/v1/messages?q=\\xc3\\xa9",
            (),
            "control character, space or non-ASCII in the path or query",
        ),
        ("/anthropic/v1/messages\\x7f", (), "control character, space or non-ASCII in the path or query"),
        ("/anthropic/v1/messages", ("X-A: b\\x01c",), "control character or non-ASCII in a header value"),
        (
            "/anthropic/v1/messages",
            ("X-A: caf\\xc3\\xa9",),
            "control character or non-ASCII in a header value",
        ),
        (
            "/anthropic/v1/messages",
            (
                "X-A: b",
                " folded",
            ),
            "control character or non-ASCII in a header value",
        ),
    ):
        out = _raw_post(env, gw, path, *headers)
        assert out.startswith("HTTP/1.1 400") and reason in out, (path, headers, out)
        line = gw.final()
        assert line["allowed"] is False and line["status"] == 400 and line["reason"] == reason, line
    code, out, err = env.sh(
        f"python3 -c {shlex.quote(RAW_POST)} {gw.ip} "
        + shlex.quote("POST /anthropic/v1/messages HTTP/1.7\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n\\r\\n")
    )
    assert code == 0 and out.startswith("HTTP/1.1 400") and "HTTP version other than" in out, (out, err)
    assert len(env.ups.requests("model.test")) == 1
    out = _raw_post(env, gw, "/anthropic/v1/messages")
    assert out.startswith("HTTP/1.1 200"), out


def test_a_key_split_across_stream_events_is_found_whatever_the_stream_looks_like(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    shapes = {
        "crlf blank line": {"separator": "\n\r\n"},
        "cr line ends": {"separator": "\r\r"},
        "not labelled a stream": {"content_type": "application/octet-stream", "prefix": "x: padding\n\n"},
        "after an oversized event": {"pad": 1100 * 1024, "chunk": 65536},
    }
    env.ups.set_script(
        [{"protocol": "anthropic", "reply": {"text": "streamed"}}]
        + [{"protocol": "anthropic", "reflect": "sse", **shape} for shape in shapes.values()]
    )
    # Allowed: an ordinary stream passes as it came.
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", {**ANTHROPIC_BODY, "stream": True})
    assert status == "200" and _sse_text(out) == "streamed", out
    for name in shapes:
        status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", {**ANTHROPIC_BODY, "stream": True})
        assert status == "200", (name, out[:300])
        text = _sse_text(out)
        assert text.startswith("the key is ") and REAL_KEY[:8] not in text, (name, text)
        assert _leaks(out, REAL_KEY) == [], (name, out[-2000:])
        line = gw.final()
        assert line["scrubbed"] == {"body": 1, "body:split": 1}, (name, line)


def test_an_engine_that_goes_away_while_waiting_is_logged_as_such_not_as_an_upstream_error(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    env.ups.set_script(
        [
            {"protocol": "anthropic", "reply": {"text": "ok"}},
            {"protocol": "anthropic", "hang": 3, "reply": {"text": "late"}},
        ]
    )
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    assert gw.final()["reason"] is None
    code, _, _ = env.sh(
        f"curl -sS -m 1 -d '{{}}' -H 'content-type: application/json' {gw.routes}/anthropic/v1/messages"
    )
    assert code != 0
    line = gw.last(route="anthropic", reason="client disconnected before the answer")
    assert line["allowed"] is True and line["status"] is None, line
    summary = gw.summary()
    assert summary["routes"]["anthropic"]["statuses"] == {"200": 1, "no answer": 1}


def _answer(ctype: str, *pieces: str) -> list[str]:
    """A raw 200 answer of this content type whose body is `pieces` (sent apart), ended by the close."""
    return [f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nConnection: close\r\n\r\n", *pieces]


def _gemini_chunk(text: str, tokens: int = 1) -> str:
    return json.dumps(
        {
            "candidates": [{"content": {"parts": [{"text": text}], "role": "model"}}],
            "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": tokens},
        }
    )


def _sse(name: str, doc: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n"


def test_a_key_split_across_json_strings_a_client_joins_is_found_in_any_body_shape(env: Env) -> None:
    routes = _routes(env)
    routes["gemini"] = {**routes["anthropic"], "header": "x-goog-api-key"}
    gw = env.gateway(routes=routes)
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "{key1}"}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "{key2}"}}
    parts = {"candidates": [{"content": {"parts": [{"text": "{key1}"}, {"text": "{key2}"}]}}]}
    second = {"candidates": [{"content": {"parts": [{"text": ""}, {"text": "{key2}"}]}}]}
    first = {"candidates": [{"content": {"parts": [{"text": "{key1}"}]}}]}
    shapes = {  # (route, how the upstream splits the key in two JSON strings an engine joins)
        "gemini array": ("gemini", _answer(
            "application/json", "[" + _gemini_chunk("key: {key1}"), "\n,\r\n" + _gemini_chunk("{key2}"), "]"
        )),
        "ndjson": ("anthropic", _answer(
            "application/x-ndjson", '{"response": "{key1}"}\n', '{"response": "{key2}"}\n'
        )),
        "block start then delta": ("anthropic", _answer(
            "text/event-stream", _sse("content_block_start", block), _sse("content_block_delta", delta)
        )),
        "two parts of one event": ("gemini", _answer("text/event-stream", f"data: {json.dumps(parts)}\n\n")),
        "parts of two events": ("gemini", _answer(
            "text/event-stream", f"data: {json.dumps(first)}\n\n", f"data: {json.dumps(second)}\n\n"
        )),
    }  # fmt: skip
    half1, half2 = REAL_KEY[: len(REAL_KEY) // 2], REAL_KEY[len(REAL_KEY) // 2 :]
    normal = _answer("application/json", "[" + _gemini_chunk("hel"), "\n,\r\n" + _gemini_chunk("lo"), "]")
    env.ups.set_script(
        [{"protocol": "gemini", "reflect": "raw", "raw": normal, "pause": 0.1}]
        + [{"protocol": r, "reflect": "raw", "raw": raw, "pause": 0.1} for r, raw in shapes.values()]
    )
    url = {
        "gemini": f"{gw.routes}/gemini/v1beta/models/g:streamGenerateContent",
        "anthropic": f"{gw.routes}/anthropic/v1/messages",
    }
    # Allowed: strings that join to ordinary text pass as they came.
    status, out = _post(env, url["gemini"], {"contents": []})
    assert status == "200" and '"text": "hel"}' in out and '"text": "lo"}' in out, out
    assert gw.final()["scrubbed"] is None
    for name, (route, _) in shapes.items():
        status, out = _post(env, url[route], ANTHROPIC_BODY)
        assert status == "200", (name, out)
        assert half1 not in out and half2 not in out and "*" * 8 in out, (name, out)
        line = gw.final()
        assert line["route"] == route and line["scrubbed"] == {"body:split": 1}, (name, line)
    # The rewritten answers are still what they were: JSON values, as long as they came.
    assert json.loads(out.split("data: ", 2)[2].strip())["candidates"][0]["content"]["parts"][1]["text"] == (
        "*" * len(half2)
    )


def test_gemini_and_json_lines_streams_without_sse_are_metered(env: Env) -> None:
    routes = _routes(env)
    routes["gemini"] = {**routes["anthropic"], "header": "x-goog-api-key"}
    gw = env.gateway(routes=routes)
    array = _answer("application/json", "[" + _gemini_chunk("a", 1), "\n,\r\n" + _gemini_chunk("b", 4), "]")
    lines = _answer(
        "application/x-ndjson",
        json.dumps({"response": "a", "usage": {"input_tokens": 7}}) + "\n",
        json.dumps({"response": "b", "usage": {"output_tokens": 3}}) + "\n",
    )
    env.ups.set_script(
        [
            {"protocol": "gemini", "reply": {"text": "g"}, "usage": {"input_tokens": 9, "output_tokens": 2}},
            {"protocol": "gemini", "reflect": "raw", "raw": array, "pause": 0.1},
            {"protocol": "anthropic", "reflect": "raw", "raw": lines, "pause": 0.1},
        ]
    )
    # Allowed: the SSE stream is metered as before.
    status, out = _post(env, f"{gw.routes}/gemini/v1beta/models/g:streamGenerateContent?alt=sse", {})
    assert status == "200" and gw.final()["usage"] == {"input_tokens": 9, "output_tokens": 2}
    status, out = _post(env, f"{gw.routes}/gemini/v1beta/models/g:streamGenerateContent", {})
    assert status == "200" and '"text": "b"' in out, out
    line = gw.final()
    assert line["usage"] == {"input_tokens": 5, "output_tokens": 4} and line["reason"] is None, line
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and '"response": "b"' in out, out
    line = gw.final()
    assert line["usage"] == {"input_tokens": 7, "output_tokens": 3} and line["reason"] is None, line


def test_a_route_upstream_answering_100_or_103_gets_the_engine_a_closed_connection_not_a_hang(
    env: Env,
) -> None:
    gw = env.gateway(routes=_routes(env))
    final = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\nafter 1xx"
    interim = {
        100: "HTTP/1.1 100 Continue\r\nX-Echo: {key}\r\n\r\n",
        103: "HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
    }
    env.ups.set_script(
        [{"protocol": "anthropic", "reflect": "raw", "raw": [final], "pause": 0.1}]
        + [
            {"protocol": "anthropic", "reflect": "raw", "raw": [h, final], "pause": 0.3}
            for h in interim.values()
        ]
        + [{"protocol": "anthropic", "reply": {"text": "ok again"}}]
    )
    # Allowed: a final answer without an interim one.
    out = _raw_post(env, gw, "/anthropic/v1/messages")
    assert out.startswith("HTTP/1.1 200") and "after 1xx" in out, out
    for code in interim:
        started = time.monotonic()
        out = _raw_post(env, gw, "/anthropic/v1/messages")
        assert time.monotonic() - started < 6 and "timed out" not in out, (code, out)
        assert "after 1xx" not in out and _leaks(out, REAL_KEY) == [], (code, out)
        line = gw.final()
        assert line["route"] == "anthropic" and line["allowed"] is False and line["status"] is None, line
        assert line["reason"] == f"route upstream answered {code} (no interim answer on a route)", line
    status, out = _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)
    assert status == "200" and "ok again" in out
    summary = gw.summary()
    assert summary["in_flight"] == 0 and summary["routes"]["anthropic"]["statuses"] == {"200": 2, "denied": 2}


def test_a_connect_sent_to_the_route_port_is_refused_and_logged(env: Env) -> None:
    gw = env.gateway(routes=_routes(env))
    send = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], 8080), timeout=5)
s.sendall(sys.argv[2].encode())
out = b""
try:
    while d := s.recv(65536):
        out += d
except OSError as e:
    out += f"<{e}>".encode()
print(out.decode("latin-1"))
"""
    # Allowed: an ordinary route request is logged as ever.
    env.ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}])
    assert _post(env, f"{gw.routes}/anthropic/v1/messages", ANTHROPIC_BODY)[0] == "200"
    before = len(gw.raw_log())
    head = "CONNECT model.test:443 HTTP/1.1\r\nHost: model.test:443\r\n\r\n"
    code, out, err = env.sh(f"python3 -c {shlex.quote(send)} {gw.ip} {shlex.quote(head)}")
    assert code == 0 and out.startswith("HTTP/1.1 400"), (out, err)
    # The route call's own final line may land after its answer: only the CONNECT's lines count.
    deadline = time.monotonic() + 5

    def connects() -> list[dict]:
        return [x for x in gw.raw_log()[before:] if x.get("method") == "CONNECT"]

    while not connects() and time.monotonic() < deadline:
        time.sleep(0.05)
    new = connects()
    assert len(new) == 1, new
    line = new[0]
    assert line["door"] == "route" and line["method"] == "CONNECT" and line["allowed"] is False, line
    assert line["status"] == 400 and line["reason"].startswith("CONNECT on the route port"), line
