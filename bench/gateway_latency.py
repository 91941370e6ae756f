"""The egress gateway's added latency per request: the same request direct vs through the gateway.

One client container (fila/testnet) sits on the upstreams' sealed network AND on a job-like
network shared only with the gateway, so both paths start in the same place:
- model: POST /v1/messages to the scripted model server (tests/upstreams), direct over HTTPS vs
  `http://<gateway>:8080/anthropic/v1/messages` (the gateway adds the key, TLS to the upstream);
- static: GET https://allowed.test/ direct vs through the proxy (CONNECT, the tunnel relayed raw).
A new connection per request on both sides (the worst case for the gateway: a TLS handshake to the
upstream every time), and the model call again on one kept-alive connection a side, as an engine's
SDK makes its calls (the whole answer, and its head: the first byte the engine reads). The
timing loop runs inside the client (no `docker exec` per request) and
alternates A B A B; the result is the median added time per request and the median paired ratio.

    .venv/bin/python -m bench.gateway_latency [--reps N] [--ca-file FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from bench.common import REPO, Ctx, Row, median, paired_ratio

sys.path.insert(0, str(REPO))  # tests.upstreams: the same servers the tests use
from tests.upstreams.fixtures import CA_IN_CONTAINER, HARDENED, IMAGE, start_upstreams

from fila.sandbox.docker.backend import DockerBackend
from fila.sandbox.images import GATEWAY_IMAGE, build

SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")
LABEL = "fila.bench"
KEY = "sk-bench-" + uuid.uuid4().hex

# Runs inside the client: A B A B ..., each request on a fresh connection; prints the samples.
_LOOP = r"""
import http.client, json, ssl, sys, time
gw, reps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = ssl.create_default_context(cafile="CA")
body = json.dumps({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
hdrs = {"content-type": "application/json", "x-api-key": "fila-placeholder"}
def call(conn, method, path, body=None, headers=None):
    t = time.perf_counter()
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse(); r.read(); conn.close()
    if r.status != 200:
        raise SystemExit(f"{method} {path}: HTTP {r.status}")
    return time.perf_counter() - t
def model_direct():
    c = http.client.HTTPSConnection("model.test", 443, context=ctx, timeout=20)
    return call(c, "POST", "/v1/messages", body, hdrs)
def model_gateway():
    c = http.client.HTTPConnection(gw, 8080, timeout=20)
    return call(c, "POST", "/anthropic/v1/messages", body, hdrs)
def static_direct():
    return call(http.client.HTTPSConnection("allowed.test", 443, context=ctx, timeout=20), "GET", "/")
def static_gateway():
    c = http.client.HTTPSConnection(gw, 3128, context=ctx, timeout=20)
    c.set_tunnel("allowed.test", 443)
    return call(c, "GET", "/")
kept = {}
def kept_call(side, make):
    # One connection per side, reused for every call as an SDK does (HTTP keep-alive); the time to
    # the answer's head (its first byte) and to its end.
    conn = kept.get(side) or kept.setdefault(side, make())
    t = time.perf_counter()
    conn.request("POST", PATHS[side], body=body, headers=hdrs)
    r = conn.getresponse(); head = time.perf_counter() - t
    r.read()
    if r.status != 200:
        raise SystemExit(f"keep-alive {side}: HTTP {r.status}")
    return time.perf_counter() - t, head
PATHS = {"gateway": "/anthropic/v1/messages", "direct": "/v1/messages"}
def kept_gateway():
    return kept_call("gateway", lambda: http.client.HTTPConnection(gw, 8080, timeout=20))
def kept_direct():
    make = lambda: http.client.HTTPSConnection("model.test", 443, context=ctx, timeout=20)
    return kept_call("direct", make)
out = {}
for name, a, b in (("model", model_gateway, model_direct), ("static", static_gateway, static_direct),
                   ("kept", kept_gateway, kept_direct)):
    xs, ys = [], []
    for i in range(warmup + reps):
        x, y = a(), b()
        if i >= warmup:
            xs.append(x); ys.append(y)
    out[name] = {"gateway": xs, "direct": ys}
kx, ky = out["kept"]["gateway"], out["kept"]["direct"]
out["kept"] = {"gateway": [x[0] for x in kx], "direct": [y[0] for y in ky]}
out["kept_head"] = {"gateway": [x[1] for x in kx], "direct": [y[1] for y in ky]}
print(json.dumps(out))
""".replace('"CA"', repr(CA_IN_CONTAINER))


def _gateway(client: docker.DockerClient, ups: Any, job_net: str, tmp: Path, session: str) -> tuple[Any, str]:
    d = tmp / "gw"
    for sub in ("secrets", "log"):
        (d / sub).mkdir(parents=True)
        os.chown(d / sub, 65534, 65534)
        (d / sub).chmod(0o700)
    secret = d / "secrets" / "anthropic"
    secret.write_text(KEY)
    os.chown(secret, 65534, 65534)
    secret.chmod(0o600)
    config = {
        "job": f"bench-{session}",
        "allow": [{"host": "allowed.test", "port": 443, "methods": None}],
        "allow_private": [ups.subnet],
        "routes": {
            "anthropic": {
                "upstream": "https://model.test",
                "header": "x-api-key",
                "format": "{key}",
                "secret": "anthropic",
            }
        },
        "budget": {"max_requests": None, "max_tokens": None},
        "upstream_ca": "/etc/fila-gateway/upstream-ca.pem",
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "config.json").chmod(0o644)
    c = client.containers.create(
        GATEWAY_IMAGE,
        name=f"fila-bench-gw-{session}",
        network=job_net,
        user="65534:65534",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=64m"},
        mem_limit="256m",
        pids_limit=128,
        labels={LABEL: session},
        volumes={
            str(d / "config.json"): {"bind": "/etc/fila-gateway/config.json", "mode": "ro"},
            str(d / "secrets"): {"bind": "/run/fila-gateway/secrets", "mode": "ro"},
            str(d / "log"): {"bind": "/var/log/fila-gateway", "mode": "rw"},
            str(ups.ca_file): {"bind": "/etc/fila-gateway/upstream-ca.pem", "mode": "ro"},
        },
    )
    client.networks.get(ups.network).connect(c)
    c.start()
    deadline = time.monotonic() + 30
    while not (d / "log" / "ready").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway not ready: {c.logs().decode(errors='replace')[-1500:]}")
        time.sleep(0.05)
    c.reload()
    return c, c.attrs["NetworkSettings"]["Networks"][job_net]["IPAddress"]


def measure(reps: int, warmup: int = 3, ca_file: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Samples per case and side: {"model": {"gateway": [...], "direct": [...]}, "static": ...}."""
    client = docker.from_env()
    build("gateway", DockerBackend(client), ca_file=ca_file, progress=lambda _: None)
    session = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="fila-bench-gw-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        (tmp / "ups").mkdir()
        (tmp / "ups").chmod(0o755)
        with start_upstreams(client, tmp / "ups") as ups:
            ups.set_script([{"protocol": "anthropic", "reply": {"text": "ok"}}] * (4 * (reps + warmup) + 4))
            net = client.networks.create(
                f"fila-bench-jobnet-{session}",
                driver="bridge",
                internal=True,
                options={"com.docker.network.bridge.inhibit_ipv4": "true"},
                labels={LABEL: session},
            )
            try:
                _, gw_ip = _gateway(client, ups, net.name, tmp, session)
                cl = client.containers.create(
                    IMAGE,
                    ["python3", "-c", _LOOP, gw_ip, str(reps), str(warmup)],
                    network=ups.network,
                    volumes={str(ups.ca_file): {"bind": CA_IN_CONTAINER, "mode": "ro"}},
                    **(HARDENED | {"labels": {LABEL: session}}),
                )
                net.connect(cl)
                log(f"gateway-latency: {reps} requests a side, alternating, after {warmup} warm-up pairs")
                cl.start()
                code = cl.wait(timeout=600)["StatusCode"]
                out = cl.logs(stdout=True, stderr=False).decode()
                if code != 0:
                    raise RuntimeError(f"client loop failed: {cl.logs().decode(errors='replace')[-1500:]}")
                return json.loads(out)
            finally:
                for c in client.containers.list(all=True, filters={"label": f"{LABEL}={session}"}):
                    with contextlib.suppress(NotFound, APIError):
                        c.remove(force=True)
                with contextlib.suppress(NotFound, APIError):
                    net.remove()


def rows(samples: dict[str, Any]) -> list[Row]:
    out = []
    for case, label in (
        ("model", "POST /v1/messages (route), a new connection each"),
        ("static", "GET https:// (CONNECT), a new connection each"),
        ("kept", "POST /v1/messages (route), one kept-alive connection a side, whole answer"),
        ("kept_head", "POST /v1/messages (route), one kept-alive connection a side, to the answer's head"),
    ):
        xs, ys = samples[case]["gateway"], samples[case]["direct"]
        added = median([x - y for x, y in zip(xs, ys, strict=True)])
        out.append(
            Row(
                f"gateway latency: {label}",
                median(xs),
                median(ys),
                "s",
                ratio=paired_ratio(xs, ys),
                note=f"+{added * 1000:.1f} ms/request",
                samples={"gateway": xs, "direct": ys},
                extra={"added_median_s": added},
            )
        )
    return out


def gateway_latency(ctx: Ctx) -> list[Row]:
    """The harness's entry point (bench/harness.py can list it as a case)."""
    ca = SYSTEM_CA if SYSTEM_CA.exists() else None
    return rows(measure(ctx.reps_or(40, 5), ca_file=ca, log=ctx.log))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_latency", description=__doc__)
    ap.add_argument("--reps", type=int, default=40, help="measured requests per side and case")
    ap.add_argument("--ca-file", type=Path, default=SYSTEM_CA if SYSTEM_CA.exists() else None)
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = rows(measure(args.reps, ca_file=args.ca_file, log=log))
    from bench.harness import table

    print(table(result))
    for r in result:
        assert r.fila is not None and r.base is not None and r.ratio is not None
        ms = f"gateway {r.fila * 1e3:.1f} ms, direct {r.base * 1e3:.1f} ms"
        print(f"{r.case}: {ms}, {r.note}, ratio {r.ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
