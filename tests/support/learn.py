"""A learning gateway on the upstreams' own sealed network (tests/upstreams), for the checks that
need to choose what a name resolves to inside the gateway (Docker's `extra_hosts`): loopback,
link-local (metadata), private and the host's own addresses. The client is a testnet container on
the same network (`Upstreams.run`), allowed by the gateway's `clients`; nothing here has a route
out (the upstreams fixture proved the network sealed)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from tests.upstreams import Upstreams

GATEWAY_IMAGE = "fila/gateway:latest"


@dataclass(frozen=True)
class LearningGateway:
    ip: str  # on the upstreams' network
    log_dir: Path

    @property
    def proxy(self) -> str:
        return f"http://{self.ip}:3128"

    def log(self) -> list[dict[str, Any]]:
        p = self.log_dir / "egress.jsonl"
        return as_read([json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else [])


def as_read(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A gateway log's lines as fila reads them (egress/record.read_log): a request's final line
    replaces its in-flight one (same id), where the request was logged as it began."""
    out: list[dict[str, Any]] = []
    at: dict[str, int] = {}
    for e in lines:
        if e.get("id") is not None and e["id"] in at:
            out[at.pop(e["id"])] = e
        else:
            if e.get("id") is not None:
                at[e["id"]] = len(out)
            out.append(e)
    return out


@contextlib.contextmanager
def learning_gateway(
    client: docker.DockerClient,
    ups: Upstreams,
    tmp: Path,
    *,
    allow: list[dict[str, Any]],
    allow_private: list[str],
    host_addresses: list[str],
    extra_hosts: dict[str, str],
    max_requests: int = 50,
    log_cap: int | None = None,
) -> Iterator[LearningGateway]:
    """A hardened gateway (uid 65534, read-only root, no capabilities) configured as fila configures
    a learning job's (`learn` on ports 80 and 443, `max_requests`), serving the upstreams' subnet.
    `log_cap`: egress.jsonl's cap in bytes (the gateway's LOG_CAP), to reach it in a few lines."""
    name = f"fila-test-learn-gw-{uuid.uuid4().hex[:8]}"
    d = tmp / name
    (d / "secrets").mkdir(parents=True)
    (d / "log").mkdir()
    for p, mode in ((d / "secrets", 0o700), (d / "log", 0o700)):
        os.chown(p, 65534, 65534)
        p.chmod(mode)
    config = {
        "job": name,
        "allow": [{"methods": None} | e for e in allow],
        "allow_private": allow_private,
        "routes": {},
        "budget": {"max_requests": max_requests, "max_tokens": None},
        "upstream_ca": None,
        "clients": [ups.subnet],
        "host_addresses": host_addresses,
        "learn": {"ports": [80, 443]},
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "config.json").chmod(0o644)
    c = client.containers.create(
        GATEWAY_IMAGE,
        name=name,
        network=ups.network,
        user="65534:65534",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=64m"},
        environment={"FILA_GATEWAY_LOG_CAP": str(log_cap)} if log_cap is not None else {},
        mem_limit="256m",
        pids_limit=128,
        sysctls={"net.ipv4.ip_unprivileged_port_start": "53"},
        extra_hosts=extra_hosts,
        labels={"fila.test": "upstreams", "fila.test.session": ups.session},
        volumes={
            str(d / "config.json"): {"bind": "/etc/fila-gateway/config.json", "mode": "ro"},
            str(d / "secrets"): {"bind": "/run/fila-gateway/secrets", "mode": "ro"},
            str(d / "log"): {"bind": "/var/log/fila-gateway", "mode": "rw"},
        },
    )
    try:
        c.start()
        deadline = time.monotonic() + 30
        while not (d / "log" / "ready").exists():
            c.reload()
            if c.status != "running" or time.monotonic() > deadline:
                raise RuntimeError(
                    f"gateway not ready ({c.status}): {c.logs().decode(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)
        c.reload()
        yield LearningGateway(c.attrs["NetworkSettings"]["Networks"][ups.network]["IPAddress"], d / "log")
    finally:
        with contextlib.suppress(NotFound, APIError):
            c.remove(force=True)
