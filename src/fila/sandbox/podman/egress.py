"""`network: allowlist` on rootless Podman: the job network and the gateway, made with Podman's
own API (`/libpod/...`), then run, read and removed like Docker's (docker_egress).

Seen on rootless Podman 4.3 with netavark 1.4 here: bridge networks live in the user's rootless
network namespace (one per user, reached out of through slirp4netns); an `internal` network gives
its containers a route to their own subnet only, and a container on two networks routes between
neither (it is not a router: ip_forward 0). So the topology is Docker's:

- the job network: internal, DNS off (no aardvark-dns on it: the engine has no resolver but the
  gateway's DNS door, which refuses and logs every lookup), labelled for the sweep;
- the gateway (fila/gateway, the user's own uid through `keep-id`, read-only, no capabilities)
  on the job network and on the egress network (fila's own non-internal bridge, out through
  slirp4netns, or one the policy names);
- the engine on the job network only, IPv6 off in its namespace, the gateway as its proxy,
  resolver and model routes.

What differs from Docker, and why it keeps the guarantees: a Podman bridge has an address in the
rootless namespace (Docker's job network has none: inhibit_ipv4); nothing of fila listens there,
DNS is off on the job network, and that namespace holds no host address (slirp4netns keeps the
host's loopback closed), which the tests probe. The gateway's memory and pids limits follow the
job's: rootless Podman on cgroup v1 ignores them, so they are set only where the policy did not
waive them (the same waiver the job needed to run at all). Podman's bridge has no `enable_icc`:
the gateways on fila-egress can reach each other, and each serves only its own job network's
subnet (the gateway's `clients`), so no job uses another's routes or keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import secrets as _secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container

from ...core.errors import ImageMissing, InfraError, InvalidPolicy
from ...core.models import Policy
from ...egress.config import (
    CONF_DIR,
    DEFAULT_EGRESS_NETWORK,
    GATEWAY_IMAGE,
    GATEWAY_MEMORY,
    GATEWAY_PIDS,
    LOG_PATH,
    READY_TIMEOUT_S,
    ROLE_EGRESS_NET,
    ROLE_GATEWAY,
    ROLE_JOB_NET,
    ROLE_LABEL,
    SECRETS_PATH,
    WAIT_ENV,
    Gateway,
    make_gateway_dir,
    network_name,
    sweep_dirs,
)
from ..base import RunResult, RunSpec, run_as
from ..docker import container as docker_container
from ..docker import egress as docker_egress
from ..docker.spec import create_kwargs
from ..gateways import GatewayPool

__all__ = ["create", "gateway_spec", "run", "start", "sweep"]

_ERRORS = (DockerException,)


def _call(client: docker.DockerClient, method: str, path: str, body: Any = None, **params: Any) -> Any:
    """One request to Podman's own API; the JSON answer (None when empty)."""
    api = client.api
    # Not api._url: its Docker API version (1.41) is refused by Podman's network endpoints.
    url = f"{api.base_url}/v4.0.0{path}"
    if method == "POST":
        res = api._post_json(url, data=body, params=params or None)
    elif method == "DELETE":
        res = api._delete(url, params=params or None)
    else:
        res = api._get(url, params=params or None)
    api._raise_for_status(res)
    return res.json() if res.content else None


def _network(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    try:
        return dict(_call(client, "GET", f"/libpod/networks/{name}/json"))
    except NotFound:
        return None


def ensure_egress_network(client: docker.DockerClient, name: str) -> None:
    """The default egress network is fila's own (a bridge out through slirp4netns), created on
    first use; a named one must exist."""
    if _network(client, name) is not None:
        return
    if name != DEFAULT_EGRESS_NETWORK:
        raise InvalidPolicy(
            f"policy field 'egress.egress_network': Podman network {name!r} does not exist",
            hint=f"create it (`podman network create {name}`), or leave egress_network unset "
            f"to use {DEFAULT_EGRESS_NETWORK}",
        )
    # DNS on (Podman's API defaults it off): the gateway resolves the names it checks through it.
    labels = {"fila": "1", ROLE_LABEL: ROLE_EGRESS_NET}
    body = {"name": name, "driver": "bridge", "dns_enabled": True, "labels": labels}
    try:
        _call(client, "POST", "/libpod/networks/create", body)
    except APIError as e:
        if e.status_code != 409:  # another worker created it meanwhile
            raise


def job_network_spec(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The job network: internal (no route out of its subnet), no IPv6, and no DNS server on it
    (the engine's only resolver is the gateway's door, which answers every lookup REFUSED)."""
    return {
        "name": name,
        "driver": "bridge",
        "internal": True,
        "ipv6_enabled": False,
        "dns_enabled": False,
        "labels": labels,
    }


def gateway_spec(
    *,
    name: str,
    job_net: str,
    egress_net: str,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    rootless: bool,
    waive: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The gateway's SpecGenerator: Docker's gateway (docker_egress._gateway_kwargs) in Podman's
    words. keep-id: the gateway runs with fila's own uid, the owner of its 0700 secrets and log."""
    mounts = [
        {"destination": CONF_DIR, "source": str(state / "conf"), "type": "bind", "options": ["rbind", "ro"]},
        {"destination": SECRETS_PATH, "source": str(state / "secrets"), "type": "bind",
         "options": ["rbind", "ro"]},
        {"destination": LOG_PATH, "source": str(state / "log"), "type": "bind", "options": ["rbind", "rw"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["rw", "nosuid", "nodev", "noexec", f"size={64 << 20}", "mode=1777"]},
    ]  # fmt: skip
    spec: dict[str, Any] = {
        "image": GATEWAY_IMAGE,
        "name": name,
        "user": f"{uid}:{gid}",
        "labels": {**labels, ROLE_LABEL: ROLE_GATEWAY},
        "mounts": mounts,
        "hostname": "gateway",
        "env": {"HOME": "/tmp", **WAIT_ENV},
        "read_only_filesystem": True,
        "cap_drop": ["ALL"],
        "no_new_privileges": True,
        "privileged": False,
        "init": True,
        "userns": {"nsmode": "keep-id"} if rootless else {"nsmode": "host"},
        "netns": {"nsmode": "bridge"},
        # Podman 4.3's SpecGenerator spells this one with a capital N.
        "Networks": {job_net: {}, egress_net: {}},
        # Not a router between its two networks, whatever an engine sends it; the DNS door binds
        # 53 as the gateway's unprivileged user; no IPv6 (no link-local path on either network).
        "sysctl": {
            "net.ipv4.ip_forward": "0",
            "net.ipv4.ip_unprivileged_port_start": "53",
            "net.ipv6.conf.all.disable_ipv6": "1",
        },
        "log_configuration": {"driver": "k8s-file", "size": 1 << 20},
    }
    limits: dict[str, Any] = {}
    if "memory" not in waive:
        limits["memory"] = {"limit": GATEWAY_MEMORY, "swap": GATEWAY_MEMORY}
    if "pids" not in waive:
        limits["pids"] = {"limit": GATEWAY_PIDS}
    if limits:
        spec["resource_limits"] = limits
    return spec


def create(
    client: docker.DockerClient,
    *,
    ident: str,
    egress_network: str,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    rootless: bool,
    waive: frozenset[str] = frozenset(),
    launch: bool = True,
) -> Gateway:
    """Docker's egress.create with Podman's own API: the job network, the gateway's empty
    directory, the gateway on both networks, started when `launch` (a spare)."""
    gw = Gateway("", network_name(ident), f"fila-gw-{ident[:90]}-{_secrets.token_hex(4)}", "", state, [])
    job = labels.get("fila.job")
    step = "creating the job network"
    try:
        ensure_egress_network(client, egress_network)
        net = _call(
            client,
            "POST",
            "/libpod/networks/create",
            job_network_spec(gw.network, {**labels, ROLE_LABEL: ROLE_JOB_NET}),
        )
        gw.subnets = [s["subnet"] for s in net.get("subnets") or [] if s.get("subnet")]
        if not gw.subnets:  # a gateway that would serve no one
            raise InfraError(f"the job network {gw.network} has no subnet", task_id=job)
        step = "making the gateway's directory"
        make_gateway_dir(state, uid, gid)
        step = "creating the gateway container"
        body = gateway_spec(
            name=gw.container,
            job_net=gw.network,
            egress_net=egress_network,
            state=state,
            labels=labels,
            uid=uid,
            gid=gid,
            rootless=rootless,
            waive=waive,
        )
        try:
            _call(client, "POST", "/libpod/containers/create", body)
        except NotFound as e:  # Podman: "<image>: image not known"
            raise ImageMissing(
                f"image {GATEWAY_IMAGE} is not in this user's Podman storage (network allowlist needs it)",
                hint="build it with `fila images build gateway`, or load Docker's: "
                "`docker save fila/gateway:latest | podman load` as this user",
                task_id=job,
            ) from e
        if launch:
            step = "starting the gateway"
            client.api.start(gw.container)
        return gw
    except BaseException as exc:
        try:
            docker_egress.stop(client, gw)
        except Exception as e:  # the original error matters more; say what is left
            exc.add_note(f"fila: could not remove the gateway {gw.container}: {e}")
        if isinstance(exc, (*_ERRORS, OSError)) and not isinstance(exc, InfraError):
            raise InfraError(f"{step} failed: {exc}", task_id=job) from exc
        raise


def start(
    client: docker.DockerClient,
    *,
    job_id: str,
    policy: Policy,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    rootless: bool,
    waive: frozenset[str] = frozenset(),
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Gateway:
    """The job's own gateway, made for it now: Docker's start with Podman's `create` (Podman's
    Docker-compatible start, inspect and logs serve the rest)."""
    return docker_egress.start(
        client,
        job_id=job_id,
        policy=policy,
        state=state,
        labels=labels,
        uid=uid,
        gid=gid,
        ready_timeout_s=ready_timeout_s,
        make=functools.partial(create, rootless=rootless, waive=waive),
    )


def run(
    spec: RunSpec,
    *,
    client: docker.DockerClient,
    create: Callable[[docker.DockerClient, dict[str, Any]], Container],
    rootless: bool,
    waive: frozenset[str],
    before_start: Callable[[str], None] | None = None,
    heartbeat: Callable[[], None] | None = None,
    heartbeat_s: float = 5.0,
    spares: GatewayPool | None = None,
) -> RunResult:
    """The job with its gateway: take the pool's spare (`spares`) or start one for the job, run the
    engine on the job network (Docker's container.run, every other step of the run as on Docker),
    then read the gateway's log into the record and remove the gateway, its network and its
    secrets (a spare: its secrets now, the rest off the job's path); on a failure remove them
    before raising."""
    uid, gid = run_as()
    gw = docker_container.start_gateway(
        client, spec, uid, gid, spares, start=functools.partial(start, rootless=rootless, waive=waive)
    )

    def on_job_network(c: docker.DockerClient, kwargs: dict[str, Any]) -> Container:
        # Docker's container.run starts Docker's gateway itself for an allowlist policy; it is given
        # the policy as `none` (no gateway of its own) and the request is made again here with this one.
        return create(c, create_kwargs(spec, kwargs["name"], gw))

    no_gateway = dataclasses.replace(spec, policy=spec.policy.model_copy(update={"network": "none"}))
    try:
        result = docker_container.run(
            no_gateway,
            client=client,
            before_start=before_start,
            heartbeat=heartbeat,
            heartbeat_s=heartbeat_s,
            create=on_job_network,
            spares=spares,  # the next spare is made once the engine runs (GatewayPool.replace)
        )
    except BaseException as exc:
        # Docker's own path for a failed run: what cannot be removed is carried on the error
        # (note_left), so the cycle keeps the task fenced instead of publishing it as over.
        docker_container.stop_gateway_after_failure(client, gw, exc)
        raise
    # The engine's container is gone already (removed inside docker_container.run). The gateway is
    # killed before its log is read, as on Docker (docker_egress.halt): what the engine left in its
    # queues is never forwarded once the log has been read. A pool's spare then leaves the job's
    # path as on Docker (docker_container's removal): its directory (the job's secrets, its log
    # read) removed now, its container removed off the path (GatewayPool.discard). That removal
    # takes seconds where Podman's storage driver is vfs (it deletes the container's copy of the
    # image: docs/benchmarks.md, "egress").
    try:
        docker_egress.halt(client, gw)
    except BaseException as exc:
        docker_container.stop_gateway_after_failure(client, gw, exc)
        raise
    result.egress, left = docker_egress.read(client, gw)
    if spares is not None and gw.spare is not None:
        left += docker_egress.forget_secrets(gw)
        spares.discard(gw)
    else:
        left += docker_egress.remove(client, gw)
    result.warnings += left
    result.gateway_timings = dict(gw.timings)
    return result


def sweep(
    client: docker.DockerClient, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
) -> list[str]:
    """Remove job networks (with any container still on them: a gateway a killed fila left) and
    gateway directories of this root's jobs whose worker holds no claim."""
    from ...core.models import valid_id

    filters = {"label": ["fila=1", f"{ROLE_LABEL}={ROLE_JOB_NET}", f"fila.root={root}"]}
    removed = []
    for net in _call(client, "GET", "/libpod/networks/json", filters=json.dumps(filters)) or []:
        labels = net.get("labels") or {}
        tid = labels.get("fila.job", "")
        if not valid_id(tid) or has_claim(tid, labels.get("fila.worker")):
            continue
        _remove_gateways(client, tid)
        with contextlib.suppress(NotFound):
            # force: a container still attached (its labels lost) is removed with the network.
            _call(client, "DELETE", f"/libpod/networks/{net['name']}", force="true")
            removed.append(f"network {net['name']}")
    return removed + sweep_dirs(meta_dir, has_claim)


def _remove_gateways(client: docker.DockerClient, job_id: str) -> None:
    """The job's gateway, when the container sweep has not removed it already."""
    flt = {"label": [f"fila.job={job_id}", f"{ROLE_LABEL}={ROLE_GATEWAY}"]}
    for c in client.api.containers(all=True, filters=flt):
        with contextlib.suppress(NotFound, ImageNotFound):
            client.api.remove_container(c["Id"], force=True, v=True)
