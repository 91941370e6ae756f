"""The gateway's start beside the engine's (docs/benchmarks.md, "The one-shot path"): its doors'
sockets are bound before mitmdump runs (images/gateway/launch.py), and what connects before the
gateway has its job's config waits in their queue and is then served under that config, never
refused for a config not yet read nor let through without it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from fila.core.models import Policy
from fila.sandbox.base import run_as
from fila.sandbox.docker import egress
from tests.upstreams.fixtures import HARDENED, IMAGE, Upstreams

pytestmark = pytest.mark.docker

# A client in the engine's network namespace: sends two CONNECTs on two connections, says so
# (/out/sent), then reads each status line (/out/status).
CLIENT = """
import socket, sys
gw = sys.argv[1]
conns = []
for target in ("allowed.test:443", "denied.test:443"):
    s = socket.create_connection((gw, 3128), timeout=60)
    s.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
    conns.append(s)
open("/out/sent", "w").close()
lines = []
for s in conns:
    head = b""
    while b"\\r\\n" not in head:
        d = s.recv(4096)
        if not d:
            break
        head += d
    lines.append(head.split(b"\\r\\n")[0].decode(errors="replace") or "(closed)")
open("/out/status", "w").write("\\n".join(lines))
"""


def _until(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)


def test_a_connection_made_before_the_gateway_has_its_config_waits_and_is_served_under_it(
    docker_client: docker.DockerClient, upstreams: Upstreams, gateway_image: str, tmp_path: Path
) -> None:
    uid, gid = run_as()
    labels = {"fila.test": "gateway-start"}
    gw = egress.create(docker_client, ident=f"test-start-{uuid.uuid4().hex[:8]}", labels=labels,
                       egress_network=upstreams.network, state=tmp_path / "gw", uid=uid, gid=gid,
                       netns=True)  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    client = None
    try:
        ip = egress.wait_ready(docker_client, gw, 60, markers=("listening",))
        client = docker_client.containers.run(
            IMAGE, ["python3", "-c", CLIENT, ip], detach=True, network_mode=f"container:{gw.netns}",
            volumes={str(out): {"bind": "/out", "mode": "rw"}}, labels=labels,
            **HARDENED,
        )  # fmt: skip
        _until("request sent", (out / "sent").exists)
        # Sent before the gateway has a config: nothing has served it (there is nothing to serve
        # it with), so it waits.
        assert not (gw.dir / "log" / "ready").exists() and not (out / "status").exists()
        policy = Policy.model_validate(
            {
                "max_timeout_ms": 60_000,
                "default_timeout_ms": 60_000,
                "network": "allowlist",
                "egress": {
                    "allow": [{"host": "allowed.test", "port": 443}],
                    "allow_private": [upstreams.subnet],
                    "egress_network": upstreams.network,
                },
            }
        )
        egress.configure(docker_client, gw, job_id="test-start", policy=policy, uid=uid, gid=gid, early=True)
        egress.wait_serving(docker_client, gw)
        assert client.wait(timeout=60)["StatusCode"] == 0, client.logs().decode(errors="replace")
        allowed, denied = (out / "status").read_text().splitlines()
        # Served under the job's config: the listed host's tunnel opens, another host is refused.
        assert " 200" in allowed and " 403" in denied, (allowed, denied)
        lines = [json.loads(x) for x in (gw.dir / "log" / "egress.jsonl").read_text().splitlines()]
        decided = {(x["host"], x["allowed"]) for x in lines if x.get("method") == "CONNECT"}
        assert {("allowed.test", True), ("denied.test", False)} <= decided, lines
        assert not [x for x in lines if "job network" in (x.get("reason") or "")], lines
    finally:
        if client is not None:
            client.remove(force=True)
        egress.stop(docker_client, gw)


# Run inside the gateway's image: what its proxy process loads (serve.py's order: fila_gw/slim.py,
# then the master), its addons, and when each TlsConfig makes its CA (mitmproxy's own beside
# fila's, which makes it only when a client's TLS is intercepted).
PROXY_PARTS = """
import json, os, sys
sys.path.insert(0, "/opt/fila-gateway")
from fila_gw.slim import addons_package_without_defaults
addons_package_without_defaults()
from fila_gw import master
from mitmproxy.addons import tlsconfig
from mitmproxy.proxy import context
from mitmproxy.test import taddons, tflow

heavy = ("passlib", "ldap3", "flask", "mitmproxy.addons.proxyauth", "mitmproxy.addons.onboarding")
out = {"loaded": sorted(m for m in heavy if m in sys.modules)}
out["addons"] = [type(a).__name__ for a in master.addons([])]
for name, cls in (("mitmproxy", tlsconfig.TlsConfig), ("fila", master.LazyCaTlsConfig)):
    d = f"/tmp/ca-{name}"
    tc = cls()
    with taddons.context(tc) as tctx:
        tctx.configure(tc, confdir=d)
        tc.running()
        at_start = os.path.exists(f"{d}/mitmproxy-ca.pem")
        entry = tc.get_cert(context.Context(tflow.tclient_conn(), tctx.options))
        out[name] = {"at_start": at_start, "after_get_cert": os.path.exists(f"{d}/mitmproxy-ca.pem"),
                     "signed_by_it": entry.cert.issuer == tc.certstore.default_ca.subject}
print(json.dumps(out))
"""


def test_the_gateways_proxy_loads_only_its_addons_and_makes_its_ca_only_when_a_client_tls_needs_it(
    docker_client: docker.DockerClient, gateway_image: str
) -> None:
    raw = docker_client.containers.run(
        gateway_image, ["-c", PROXY_PARTS], entrypoint="python3", remove=True, network_mode="none",
        labels={"fila.test": "gateway-start"}, **HARDENED,
    )  # fmt: skip
    out = json.loads(raw)
    # None of mitmdump's unused addons (web onboarding, proxy authentication) nor their libraries.
    assert out["loaded"] == [], out
    assert out["addons"] == [
        "Core", "Block", "DisableH2C", "Proxyserver", "NextLayer",
        "LazyCaTlsConfig", "UpdateAltSvc", "ErrorCheck",
    ]  # fmt: skip
    # mitmproxy's TlsConfig makes its CA when configured; the gateway's only at the first client
    # certificate it must sign, then signs with it as mitmproxy's does.
    assert out["mitmproxy"] == {"at_start": True, "after_get_cert": True, "signed_by_it": True}
    assert out["fila"] == {"at_start": False, "after_get_cert": True, "signed_by_it": True}
