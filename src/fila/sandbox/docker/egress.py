"""The job network and the egress gateway on Docker (network allowlist): created before the
engine, removed after it, swept by label after a crash. What the gateway is and logs (its
configuration, the record's egress section) is egress/config.py's; this module only talks to Docker."""

from __future__ import annotations

import contextlib
import secrets as _secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.models.networks import Network

from ...core.errors import InfraError, InvalidPolicy
from ...core.models import EgressRecord, Policy
from ...egress.config import (
    CONFIG_PATH,
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
    UPSTREAM_CA_PATH,
    Gateway,
    collect,
    job_labels,
    network_name,
    prepare_gateway_dir,
    remove_dir,
    sweep_dirs,
)

__all__ = ["collect", "died", "ensure_egress_network", "gateway_files", "start", "stop", "sweep"]


def _docker_errors() -> tuple[type[BaseException], ...]:
    import requests
    from docker.errors import DockerException

    return (DockerException, requests.RequestException)


def ensure_egress_network(client: docker.DockerClient, name: str) -> None:
    """The default egress network is fila's own, created on first use; a named one must exist."""
    from docker.errors import NotFound

    try:
        client.networks.get(name)
        return
    except NotFound:
        pass
    if name != DEFAULT_EGRESS_NETWORK:
        raise InvalidPolicy(
            f"policy field 'egress.egress_network': Docker network {name!r} does not exist",
            hint=f"create it, or leave egress_network unset to use {DEFAULT_EGRESS_NETWORK}",
        )
    from docker.errors import APIError

    try:
        # No traffic between containers on it: one job's gateway never reaches another's routes.
        client.networks.create(
            name,
            driver="bridge",
            options={"com.docker.network.bridge.enable_icc": "false"},
            labels={"fila": "1", ROLE_LABEL: ROLE_EGRESS_NET},
        )
    except APIError as e:
        if e.status_code != 409:  # another worker created it meanwhile
            raise


def _gateway_kwargs(
    job_id: str, name: str, net: str, state: Path, labels: dict[str, str], uid: int, gid: int, ca: bool
) -> dict[str, Any]:
    from docker.types import LogConfig, Mount

    mounts = [
        Mount(CONFIG_PATH, str(state / "config.json"), type="bind", read_only=True),
        Mount(SECRETS_PATH, str(state / "secrets"), type="bind", read_only=True),
        Mount(LOG_PATH, str(state / "log"), type="bind", read_only=False),
    ]
    if ca:
        mounts.append(Mount(UPSTREAM_CA_PATH, str(state / "upstream-ca.pem"), type="bind", read_only=True))
    return dict(
        image=GATEWAY_IMAGE,
        name=name,
        user=f"{uid}:{gid}",
        labels=job_labels(job_id, ROLE_GATEWAY, labels),
        mounts=mounts,
        network=net,
        hostname="gateway",
        read_only=True,
        tmpfs={"/tmp": f"rw,nosuid,nodev,noexec,size={64 << 20},mode=1777"},
        environment={"HOME": "/tmp"},
        # On two networks with forwarding inherited from the host (1): it must never route packets
        # between the job network and the egress network, whatever an engine sends it.
        # ip_unprivileged_port_start: the DNS door (port 53) binds as uid 65534, with no capability;
        # the engine's every lookup is answered REFUSED and logged instead of going unanswered.
        sysctls={"net.ipv4.ip_forward": "0", "net.ipv4.ip_unprivileged_port_start": "53"},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        init=True,
        mem_limit=GATEWAY_MEMORY,
        memswap_limit=GATEWAY_MEMORY,
        pids_limit=GATEWAY_PIDS,
        log_config=LogConfig(type=LogConfig.types.JSON, config={"max-size": "1m", "max-file": "2"}),
    )


def start(
    client: docker.DockerClient,
    *,
    job_id: str,
    policy: Policy,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Gateway:
    """Create the job network, write the gateway's files, start it and wait until it is ready.
    On any failure what was made is removed before the error is raised."""
    from docker.errors import ImageNotFound

    from ...core.errors import ImageMissing

    assert policy.egress is not None
    gw = Gateway(
        job_id, network_name(job_id), f"fila-gw-{job_id[:90]}-{_secrets.token_hex(4)}", "", state, []
    )
    step = "creating the job network"
    try:
        ensure_egress_network(client, policy.egress.egress_network)
        net = client.networks.create(
            gw.network,
            driver="bridge",
            internal=True,
            enable_ipv6=False,
            # Without this the bridge holds an address, and through it the host's services.
            options={"com.docker.network.bridge.inhibit_ipv4": "true"},
            labels=job_labels(job_id, ROLE_JOB_NET, labels),
        )
        net.reload()
        subnets = [c["Subnet"] for c in (net.attrs.get("IPAM") or {}).get("Config") or [] if c.get("Subnet")]
        step = "writing the gateway's configuration"
        ca = gateway_files(gw, policy, uid, gid, subnets)
        step = "creating the gateway container"
        kwargs = _gateway_kwargs(job_id, gw.container, gw.network, state, labels, uid, gid, ca)
        try:
            client.containers.create(**kwargs)
        except ImageNotFound as e:
            raise ImageMissing(
                f"image {GATEWAY_IMAGE} is not present (network allowlist needs it)",
                hint="build it with `fila images build gateway`",
                task_id=job_id,
            ) from e
        step = f"attaching the gateway to {policy.egress.egress_network}"
        client.networks.get(policy.egress.egress_network).connect(gw.container)
        step = "starting the gateway"
        client.api.start(gw.container)
        step = "waiting for the gateway"
        gw.ip = wait_ready(client, gw, ready_timeout_s)
        return gw
    except BaseException as exc:
        try:
            stop(client, gw)
        except Exception as e:  # the original error matters more; say what is left
            exc.add_note(f"fila: could not remove the gateway of {job_id}: {e}")
        if isinstance(exc, _docker_errors()):
            raise InfraError(f"{step} failed: {exc}", task_id=job_id) from exc
        raise


def gateway_files(gw: Gateway, policy: Policy, uid: int, gid: int, subnets: list[str]) -> bool:
    """Write the gateway's files for the job network's subnets (its only clients) and note its
    routes on `gw`; True when a route needs an upstream CA mounted. Docker's and Podman's start
    share it: a job network without a subnet would leave the gateway serving no one."""
    if not subnets:
        raise InfraError(f"the job network {gw.network} has no subnet", task_id=gw.job_id)
    routes = prepare_gateway_dir(gw.dir, policy, gw.job_id, uid, gid, clients=subnets)
    gw.routes = [r.name for r in routes]
    return any(r.ca_file for r in routes)


def wait_ready(client: docker.DockerClient, gw: Gateway, timeout_s: float) -> str:
    ready = gw.dir / "log" / "ready"
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.api.inspect_container(gw.container)
        st = info["State"]
        if not st.get("Running"):
            raise InfraError(
                f"the gateway exited (code {st.get('ExitCode')}) before it was ready: "
                f"{_log_tail(client, gw)}",
                task_id=gw.job_id,
                hint=f"check the image {GATEWAY_IMAGE} (`fila images build gateway`) and `fila doctor`",
            )
        if ready.exists():
            ip = info["NetworkSettings"]["Networks"].get(gw.network, {}).get("IPAddress")
            if not ip:
                raise InfraError(f"the gateway has no address on {gw.network}", task_id=gw.job_id)
            return str(ip)
        if time.monotonic() > deadline:
            raise InfraError(
                f"the gateway was not ready within {timeout_s:g} s: {_log_tail(client, gw)}",
                task_id=gw.job_id,
                hint="the host may be overloaded; the task is retried with backoff",
            )
        time.sleep(0.05)


def _log_tail(client: docker.DockerClient, gw: Gateway, n: int = 2000) -> str:
    from ...workspace.fswalk import inert

    try:
        raw = client.api.logs(gw.container, stdout=True, stderr=True, tail=20)
    except _docker_errors() as e:
        return f"(its log could not be read: {e})"
    return inert(raw[-n:].decode("utf-8", "replace").strip().replace("\n", " | ")) or "(empty log)"


def died(client: docker.DockerClient, gw: Gateway) -> str | None:
    """After the engine's run: a warning when the gateway was not running any more (the engine
    lost its network and its routes part-way; the log may end early)."""
    try:
        st = client.api.inspect_container(gw.container)["State"]
    except _docker_errors() as e:
        return f"the job's gateway could not be checked after the run: {e}"
    if st.get("Running"):
        return None
    return (
        f"the job's gateway exited during the run (code {st.get('ExitCode')}, OOM killed: "
        f"{bool(st.get('OOMKilled'))}): the engine lost its network from then on; {_log_tail(client, gw)}"
    )


def finish(client: docker.DockerClient, gw: Gateway) -> tuple[EgressRecord, list[str]]:
    """After the engine's container is gone: the gateway's log read into the record's egress
    section, then the gateway, its network and secrets removed. Returns the section and what the
    record must warn of (a gateway that died during the run, one left for `fila recover`)."""
    record, left = collect(gw), []
    if dead := died(client, gw):
        left.append(dead)
    try:
        stop(client, gw)
    except InfraError as e:  # the run itself is complete: say what is left, keep the result
        left.append(f"{e}; `fila recover` removes it")
    return record, left


def stop(client: docker.DockerClient, gw: Gateway) -> None:
    """Remove the gateway, the job network and the gateway's directory (secrets included). The
    log is read first by the caller (`collect`)."""
    from docker.errors import APIError, NotFound

    errors = []
    try:
        client.api.remove_container(gw.container, force=True, v=True)
    except NotFound:
        pass
    except APIError as e:
        if not (e.status_code == 409 and "already in progress" in str(e)):
            errors.append(f"gateway {gw.container}: {e}")
    try:
        client.api.remove_network(gw.network)
    except NotFound:
        pass
    except APIError as e:
        errors.append(f"network {gw.network}: {e}")
    try:
        remove_dir(gw.dir)
    except OSError as e:
        errors.append(f"{gw.dir}: {e}")
    if errors:
        raise InfraError("could not remove " + "; ".join(errors), task_id=gw.job_id)


def sweep(
    client: docker.DockerClient, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
) -> list[str]:
    """Remove job networks and gateway directories of this root's jobs whose worker holds no
    claim (their gateways are containers: the container sweep removed them first). Returns
    what was removed, described."""
    from ...core.models import valid_id

    removed = []
    found = client.networks.list(
        filters={"label": ["fila=1", f"{ROLE_LABEL}={ROLE_JOB_NET}", f"fila.root={root}"]}
    )
    for net in found:
        labels = net.attrs.get("Labels") or {}
        tid = labels.get("fila.job", "")
        if not valid_id(tid) or has_claim(tid, labels.get("fila.worker")):
            continue
        _remove_net_containers(client, net)
        with contextlib.suppress(*_not_found()):
            client.api.remove_network(net.id)
            removed.append(f"network {net.name}")
    return removed + sweep_dirs(meta_dir, has_claim)


def _remove_net_containers(client: docker.DockerClient, net: Network) -> None:
    """A gateway of the job still attached (its labels lost, or created by a killed fila): force
    it off the network by removing it, when it is fila's."""
    with contextlib.suppress(*_docker_errors()):
        net.reload()
        for cid in net.attrs.get("Containers") or {}:
            c = client.containers.get(cid)
            if (c.labels or {}).get("fila") == "1":
                client.api.remove_container(cid, force=True, v=True)


def _not_found() -> tuple[type[BaseException], ...]:
    from docker.errors import NotFound

    return (NotFound,)
