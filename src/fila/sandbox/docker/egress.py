"""The job network and the egress gateway on Docker (network allowlist): created before the
engine, removed after it, swept by label after a crash. What the gateway is and logs (its
configuration, the record's egress section) is egress/config.py's; this module only talks to Docker."""

from __future__ import annotations

import contextlib
import secrets as _secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.models.networks import Network

from ...core.errors import InfraError, InvalidPolicy
from ...core.models import EgressRecord, Policy
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
    ROLE_NETNS,
    SECRETS_PATH,
    SPARE_LABEL,
    WAIT_ENV,
    Gateway,
    collect,
    job_labels,
    make_gateway_dir,
    network_name,
    remove_dir,
    sweep_dirs,
    write_gateway_config,
)
from . import subnets
from .removal import SETTLE_S, departs, departure, remove_container, remove_in_turn
from .subnets import JobSubnet

__all__ = [
    "collect",
    "configure",
    "create",
    "died",
    "ensure_egress_network",
    "forget_secrets",
    "halt",
    "read",
    "remove",
    "start",
    "stop",
    "sweep",
    "sweep_spares",
    "wait_serving",
]  # fmt: skip


# How long the gateway's death is waited for after its kill (its `die` comes 0.02-0.03 s after
# it): past it the job fails (InfraError) rather than hang with the gateway's state unknown.
HALT_TIMEOUT_S = 30.0


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
    name: str,
    net: str,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    client: docker.DockerClient,
    ip: str | None = None,
) -> dict[str, Any]:
    from docker.types import LogConfig, Mount

    mounts = [
        Mount(CONF_DIR, str(state / "conf"), type="bind", read_only=True),
        Mount(SECRETS_PATH, str(state / "secrets"), type="bind", read_only=True),
        Mount(LOG_PATH, str(state / "log"), type="bind", read_only=False),
    ]
    return dict(
        image=GATEWAY_IMAGE,
        name=name,
        user=f"{uid}:{gid}",
        labels={**labels, ROLE_LABEL: ROLE_GATEWAY},
        mounts=mounts,
        **_on_network(client, net, ip),
        hostname="gateway",
        read_only=True,
        tmpfs={"/tmp": f"rw,nosuid,nodev,noexec,size={64 << 20},mode=1777"},
        environment={"HOME": "/tmp", **WAIT_ENV},
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


def create(
    client: docker.DockerClient,
    *,
    ident: str,
    egress_network: str,
    state: Path,
    labels: dict[str, str],
    uid: int,
    gid: int,
    launch: bool = True,
    netns: bool = False,
) -> Gateway:
    """A gateway not yet any job's: its job network (internal, no address on the bridge, on a
    subnet of FILA_JOB_SUBNETS: sandbox/docker/subnets.py), its empty directory, its container on
    both networks, started when `launch` (a spare: it listens and refuses everything until
    `configure` writes a job's config). `labels` say whose it is (a job's, or a pool's spare).
    `netns` (a started spare): also a holder of a network namespace on the job network for the
    engine to join (`Gateway.netns`), made and started beside the gateway (its resolver, the
    gateway's address, is fixed in the chosen subnet; with Docker's choice of subnet it follows
    the gateway's start). On any failure what was made is removed before the error is raised."""
    gw = Gateway("", network_name(ident), f"fila-gw-{ident[:90]}-{_secrets.token_hex(4)}", "", state, [])
    job = labels.get("fila.job")
    step = "creating the job network"
    try:
        ensure_egress_network(client, egress_network)
        chosen = _job_network(client, gw, labels)
        step = "making the gateway's directory"
        make_gateway_dir(state, uid, gid)
        if netns:
            gw.netns = f"{gw.container}-netns"  # removed with the gateway (`stop`) from here on
        if chosen is not None and netns:
            step = "starting the gateway and the job network's namespace holder"
            _beside(
                client,
                lambda c: _make_gateway(c, gw, egress_network, labels, uid, gid, launch, chosen.gateway),
                lambda c: _start_netns(c, gw, labels, chosen.gateway, chosen.holder),
            )
        else:
            step = "creating the gateway container"
            _make_gateway(
                client, gw, egress_network, labels, uid, gid, launch, chosen.gateway if chosen else None
            )
            if netns:
                step = "starting the job network's namespace holder"
                ip = client.api.inspect_container(gw.container)["NetworkSettings"]["Networks"][gw.network]
                _start_netns(client, gw, labels, ip["IPAddress"])
        return gw
    except BaseException as exc:
        raise _undone(client, gw, exc, step, job) from None


def _job_network(client: docker.DockerClient, gw: Gateway, labels: dict[str, str]) -> JobSubnet | None:
    """The job network, on a subnet of fila's pool (returned) or, with FILA_JOB_SUBNETS=docker,
    of Docker's choosing (None). `gw.subnets` is set either way."""
    kwargs: dict[str, Any] = dict(
        driver="bridge",
        internal=True,
        enable_ipv6=False,
        # Without this the bridge holds an address, and through it the host's services.
        options={"com.docker.network.bridge.inhibit_ipv4": "true"},
        labels={**labels, ROLE_LABEL: ROLE_JOB_NET},
    )
    nets = subnets.pool()
    if nets is not None:
        _, chosen = subnets.create_network(client, gw.network, nets, **kwargs)
        gw.subnets = [str(chosen.subnet)]
        return chosen
    net = client.networks.create(gw.network, **kwargs)
    net.reload()
    ipam = (net.attrs.get("IPAM") or {}).get("Config") or []
    gw.subnets = [c["Subnet"] for c in ipam if c.get("Subnet")]
    if not gw.subnets:  # a gateway that would serve no one
        raise InfraError(f"the job network {gw.network} has no subnet", task_id=labels.get("fila.job"))
    return None


def _beside(client: docker.DockerClient, *steps: Callable[[docker.DockerClient], None]) -> None:
    """`steps` run side by side, the first on `client`, each other on a connection of its own;
    the first error raised once all are done."""
    from .client import fresh_client

    failed: list[BaseException] = []

    def run(step: Callable[[docker.DockerClient], None], own: bool) -> None:
        try:
            c = fresh_client(client) if own else client
            try:
                step(c)
            finally:
                if own:
                    c.close()
        except BaseException as e:
            failed.append(e)

    threads = [
        threading.Thread(target=run, args=(step, True), name=f"fila-gw-make-{i}", daemon=True)
        for i, step in enumerate(steps[1:], 1)
    ]
    for t in threads:
        t.start()
    run(steps[0], False)
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def _make_gateway(
    client: docker.DockerClient,
    gw: Gateway,
    egress_network: str,
    labels: dict[str, str],
    uid: int,
    gid: int,
    launch: bool,
    ip: str | None,
) -> None:
    """The gateway's container, at `ip` on the job network when given, attached to the egress
    network, started when `launch`."""
    from docker.errors import ImageNotFound

    from ...core.errors import ImageMissing

    try:
        client.containers.create(
            **_gateway_kwargs(gw.container, gw.network, gw.dir, labels, uid, gid, client, ip)
        )
    except ImageNotFound as e:
        raise ImageMissing(
            f"image {GATEWAY_IMAGE} is not present (network allowlist needs it)",
            hint="build it with `fila images build gateway`",
            task_id=labels.get("fila.job"),
        ) from e
    # By name (checked by ensure_egress_network): a network object would be one inspection more.
    client.api.connect_container_to_network(gw.container, egress_network)
    if launch:
        client.api.start(gw.container)


def _start_netns(
    client: docker.DockerClient, gw: Gateway, labels: dict[str, str], gateway_ip: str, ip: str | None = None
) -> None:
    """The engine's network namespace, made before its job: a container that only sleeps, on the
    job network alone (at `ip` when given), with the gateway as its resolver, hardened as the
    engine is. The engine joins it (`container:` network mode); it is removed with the gateway
    (`gw.netns`), never shared by jobs."""
    from docker.types import LogConfig

    assert gw.netns is not None
    client.containers.create(
        image=GATEWAY_IMAGE,
        name=gw.netns,
        entrypoint=["sleep", "infinity"],
        user="65534:65534",
        labels={**labels, ROLE_LABEL: ROLE_NETNS},
        **_on_network(client, gw.network, ip),
        dns=[gateway_ip],
        hostname="fila",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        init=True,
        mem_limit=16 << 20,
        memswap_limit=16 << 20,
        pids_limit=8,
        log_config=LogConfig(type=LogConfig.types.NONE),
    )
    client.api.start(gw.netns)


def _on_network(client: docker.DockerClient, network: str, ip: str | None) -> dict[str, Any]:
    """A container's create arguments for its network, at `ip` when given (else the daemon's
    choice)."""
    if ip is None:
        return {"network": network}
    return {
        "network": network,
        "networking_config": {network: client.api.create_endpoint_config(ipv4_address=ip)},
    }


def configure(
    client: docker.DockerClient,
    gw: Gateway,
    *,
    job_id: str,
    policy: Policy,
    uid: int,
    gid: int,
    launch: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
    early: bool = False,
) -> Gateway:
    """Make `gw` the job's: its secrets and config written (the config last: a started gateway
    loads it the moment it appears), started when `launch`, then waited for until ready, or with
    `early` only until its sockets are bound (`listening`): the engine may start then, its
    connections waiting in the gateway's queues until it serves, and the caller waits for that
    with `wait_serving` once the engine has started (docs/benchmarks.md, "The one-shot path"). On
    any failure the gateway is removed before the error is raised."""
    gw.job_id = job_id
    step = "writing the gateway's configuration"
    try:
        routes = write_gateway_config(gw.dir, policy, job_id, uid, gid, clients=gw.subnets)
        gw.routes = [r.name for r in routes]
        if launch:
            step = "starting the gateway"
            client.api.start(gw.container)
        step = "waiting for the gateway"
        t = time.monotonic()
        ip = wait_ready(client, gw, ready_timeout_s, markers=("listening", "ready") if early else ("ready",))
        assert ip is not None  # without `until`: an address or an error
        gw.ip = ip
        gw.serving = not early
        gw.timings["gateway_ready"] = round(time.monotonic() - t, 3)
        return gw
    except BaseException as exc:
        raise _undone(client, gw, exc, step, job_id) from None


def _undone(
    client: docker.DockerClient, gw: Gateway, exc: BaseException, step: str, job_id: str | None
) -> BaseException:
    """What to raise after a failed step, once what was made of `gw` is removed: a Docker error
    as an InfraError naming the step, anything else as it is."""
    try:
        stop(client, gw)
    except Exception as e:  # the original error matters more; say what is left
        exc.add_note(f"fila: could not remove the gateway {gw.container}: {e}")
    if isinstance(exc, _docker_errors()):
        err = InfraError(f"{step} failed: {exc}", task_id=job_id)
        err.__cause__ = exc
        return err
    return exc


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
    make: Callable[..., Gateway] | None = None,
    early: bool = False,
) -> Gateway:
    """A job's own gateway, made for it now (no spare to take): created (by `make`, Podman's
    `create` on Podman), configured, started, ready (with `early`: listening, see `configure`).
    Its `timings`: gateway_start (the network and the container), gateway_ready."""
    assert policy.egress is not None
    t = time.monotonic()
    gw = (make or create)(
        client,
        ident=job_id,
        egress_network=policy.egress.egress_network,
        state=state,
        labels=job_labels(job_id, ROLE_GATEWAY, labels),
        uid=uid,
        gid=gid,
        launch=False,
    )
    gw.timings["gateway_start"] = round(time.monotonic() - t, 3)
    return configure(
        client,
        gw,
        job_id=job_id,
        policy=policy,
        uid=uid,
        gid=gid,
        launch=True,
        ready_timeout_s=ready_timeout_s,
        early=early,
    )


def wait_serving(
    client: docker.DockerClient,
    gw: Gateway,
    timeout_s: float = READY_TIMEOUT_S,
    *,
    until: threading.Event | None = None,
) -> None:
    """After the engine's start, for a gateway configured `early`: wait until it serves (`ready`:
    its config loaded, its doors taking what queued meanwhile), or until `until` is set (the
    engine's container exited first: nothing it asked was served, and `halt` makes sure nothing
    queued ever is). Its seconds are `gw.timings["gateway_serve"]`: the part of the gateway's
    start the engine's own did not hide. InfraError when it exits or times out first (the caller
    stops the engine)."""
    if gw.serving:
        return
    t = time.monotonic()
    gw.serving = wait_ready(client, gw, timeout_s, until=until) is not None
    gw.timings["gateway_serve"] = round(time.monotonic() - t, 3)


def halt(client: docker.DockerClient, gw: Gateway, timeout_s: float = HALT_TIMEOUT_S) -> None:
    """After the engine's exit, the gateway is killed before its log is read, serving or not: no
    request the engine left in its queues is forwarded once its log has been read, and the
    gateway logs each request it lets through as it begins (then as it ends, one id), so the
    record holds every request that passed, one whose end the gateway did not see shown as in
    flight (egress/record.read_log; below the log's cap); its log is written a line at a time,
    and the kill loses none.
    Returns once the daemon says the gateway died of this kill (its event stream says `kill`,
    then `die`, sent once the container's init, and with it every process of its PID namespace,
    is gone), not once the kill request returns: that waits for the daemon's clean-up of the
    gateway's two network endpoints too, a tenth of a second more on the job's path that the
    record does not need (docs/benchmarks.md, "The one-shot path"); bytes the dead gateway had
    already written to its sockets, of requests its log holds, may still leave until then. The
    order is the daemon's own (no clock is compared: a daemon in a VM behind a Unix socket keeps
    its own), so a gateway that died during the run is never taken for one killed here. The
    kill's answer also ends the wait (an engine whose events say nothing, a daemon elsewhere),
    and says a gateway not running any more (404, 409: `died` reports it); neither within
    `timeout_s` (a daemon that does not answer) is an InfraError.
    The kill holds the daemon's departure lock until its answer (sandbox/docker/removal.py: two
    gateways leaving the shared egress network at once can deadlock Docker 20.10), so a kill
    waits for another job's gateway's departure first: `gw.timings["gateway_depart"]` in the
    record, or `gateway_depart_unlocked` when it went without (none to take, or not free within
    removal.DEPARTURE_WAIT_S); `timeout_s` counts from the kill, after that wait.
    Removal follows as for any gateway (docs/security.md, "Spare gateways")."""
    from .client import fresh_client, socket_path

    since = time.time() - 1.0  # the stream replays from here; the order of its events decides
    done = threading.Event()
    answer: list[BaseException | None] = []
    killed_it: list[bool] = []
    waited: list[float] = []  # the kill's wait for the departure lock, not the daemon's
    watch = _Watch()

    def kill() -> None:
        try:
            own = fresh_client(client)
            try:
                t = time.monotonic()
                with departure(own) as held:  # until the answer: its endpoints are released by then
                    waited.append(round(time.monotonic() - t, 3))
                    gw.timings["gateway_depart" if held else "gateway_depart_unlocked"] = waited[0]
                    own.api.kill(gw.container)
                    answer.append(None)
                    done.set()  # on the answer, not after the lock's pause
            finally:
                own.close()
        except BaseException as e:
            if not answer:
                answer.append(e)
        finally:
            done.set()

    def watched() -> None:
        with contextlib.suppress(Exception):  # no stream: the kill's answer alone
            own = fresh_client(client)
            try:
                stream = own.api.events(
                    since=f"{since:.6f}",
                    until=f"{since + 1.0 + timeout_s:.6f}",
                    filters={"container": [gw.container], "event": ["kill", "die", "died"]},
                    decode=True,
                )
                if watch.hold(stream) and _killed_then_died(stream, gw.container):
                    killed_it.append(True)
                    done.set()
            finally:
                own.close()

    if socket_path(client) is not None:  # a stream of its own, on a connection of its own
        threading.Thread(target=watched, name=f"fila-halt-watch-{gw.container}", daemon=True).start()
    threading.Thread(target=kill, name=f"fila-halt-{gw.container}", daemon=True).start()
    done.wait(timeout_s)
    if not done.is_set() and waited:
        done.wait(waited[0])  # the daemon's timeout_s counts from the kill, not the lock's wait
    watch.end()
    if killed_it:
        gw.halted = gw.stopped = True
        return
    if not answer:
        raise InfraError(
            f"stopping the job's gateway {gw.container}: the Docker daemon did not answer within "
            f"{timeout_s:g} s",
            hint="check the daemon (`docker info`); `fila recover` removes what the job left",
            task_id=gw.job_id,
        )
    e = answer[0]
    if e is None:
        gw.halted = gw.stopped = True
        return
    if getattr(e, "status_code", None) in (404, 409):  # it died (or went) before: `died` says so
        gw.stopped = True
        return
    if isinstance(e, _docker_errors()):
        raise InfraError(f"stopping the job's gateway {gw.container} failed: {e}", task_id=gw.job_id) from e
    raise e


class _Watch:
    """halt's event stream, closed once the wait is over, also when it opens only after that."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream: Any = None
        self._over = False

    def hold(self, stream: Any) -> bool:
        """Keep `stream` to close at the wait's end; False (closed now) when it is over."""
        with self._lock:
            if not self._over:
                self._stream = stream
                return True
        with contextlib.suppress(Exception):
            stream.close()
        return False

    def end(self) -> None:
        with self._lock:
            self._over, stream = True, self._stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()


def _killed_then_died(stream: Any, name: str) -> bool:
    """Whether the stream said that container `name` was killed, then died, before it ended
    (closed at the wait's end, or its `until` passed). Only the exact name counts: the daemon's
    `container` filter also matches names that begin with it (the gateway's namespace holder,
    `<name>-netns`). Podman's compatible API files a death under `died`, reported as `die`."""
    killed = False
    try:
        for event in stream:
            if not isinstance(event, dict):
                continue
            actor = event.get("Actor")
            attributes = actor.get("Attributes") if isinstance(actor, dict) else None
            if not (isinstance(attributes, dict) and attributes.get("name") == name):
                continue
            action = event.get("Action", event.get("status"))
            if action == "kill":
                killed = True
            elif action in ("die", "died") and killed:
                return True
    except Exception:  # closed under it at the wait's end
        return False
    return False


def wait_ready(
    client: docker.DockerClient,
    gw: Gateway,
    timeout_s: float,
    *,
    markers: tuple[str, ...] = ("ready",),
    until: threading.Event | None = None,
) -> str | None:
    """The gateway's address on its job network once it has written one of `markers` in its log
    directory: `ready` (serving) or `listening` (its sockets bound: launch.py); None once `until`
    is set first."""
    log = gw.dir / "log"
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
        if any((log / m).exists() for m in markers):
            ip = info["NetworkSettings"]["Networks"].get(gw.network, {}).get("IPAddress")
            if not ip:
                raise InfraError(f"the gateway has no address on {gw.network}", task_id=gw.job_id)
            return str(ip)
        if until is not None and until.is_set():
            return None
        if time.monotonic() > deadline:
            raise InfraError(
                f"the gateway was not ready within {timeout_s:g} s: {_log_tail(client, gw)}",
                task_id=gw.job_id,
                hint="the host may be overloaded; the task is retried with backoff",
            )
        # The marker is looked for every 10 ms (a spare is ready within a few), the container's
        # state every 100 ms.
        for _ in range(10):
            if until is not None:
                if until.wait(0.01):
                    break
            else:
                time.sleep(0.01)
            if any((log / m).exists() for m in markers):
                break


def _log_tail(client: docker.DockerClient, gw: Gateway, n: int = 2000) -> str:
    from ...workspace.fswalk import inert

    try:
        raw = client.api.logs(gw.container, stdout=True, stderr=True, tail=20)
    except _docker_errors() as e:
        return f"(its log could not be read: {e})"
    return inert(raw[-n:].decode("utf-8", "replace").strip().replace("\n", " | ")) or "(empty log)"


def died(client: docker.DockerClient, gw: Gateway) -> str | None:
    """After the engine's run: a warning when the gateway was not running any more (the engine
    lost its network and its routes part-way; the log may end early). A gateway `halt` killed
    after the engine's exit is no loss."""
    if gw.halted:
        return None
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


def read(client: docker.DockerClient, gw: Gateway) -> tuple[EgressRecord, list[str]]:
    """After the engine's run: the gateway's log read into the record's egress section, and what
    the record must warn of (a gateway that died during the run)."""
    record = collect(gw)
    return record, [dead] if (dead := died(client, gw)) else []


def remove(
    client: docker.DockerClient, gw: Gateway, *, before_network: Callable[[], None] | None = None
) -> list[str]:
    """stop(), with what could not be removed returned as the record's warnings: the run itself
    is complete, and `fila recover` sweeps what is left."""
    try:
        stop(client, gw, before_network=before_network)
    except InfraError as e:
        return [f"{e}; `fila recover` removes it"]
    return []


def forget_secrets(gw: Gateway) -> list[str]:
    """What a job taking a pool's spare waits for at its end: the gateway's directory (the
    job's secrets and log, read already) removed. The gateway was killed before its log was read
    (`halt`); its container, holder and network are removed after the record, off the job's path
    (GatewayPool.discard). What could not be done is returned as the record's warning. Its
    seconds are `gw.timings["gateway_remove"]`."""
    t = time.monotonic()
    try:
        remove_dir(gw.dir)
        gw.dir_gone = True  # the path is free: a fallback attempt's gateway may use it next
    except OSError as e:
        return [f"could not remove {gw.dir}: {e}; `fila recover` removes it"]
    finally:
        gw.timings["gateway_remove"] = round(time.monotonic() - t, 3)
    return []


def finish(client: docker.DockerClient, gw: Gateway) -> tuple[EgressRecord, list[str]]:
    """After the engine's container is gone: read(), then remove()."""
    record, left = read(client, gw)
    return record, left + remove(client, gw)


def stop(
    client: docker.DockerClient, gw: Gateway, *, before_network: Callable[[], None] | None = None
) -> None:
    """Remove the gateway, the job network and the gateway's directory (secrets included). The
    log is read first by the caller (`collect`). The gateway goes first, then the namespace
    holder, one after the other (sandbox/docker/removal.py: two containers leaving one network at
    once can deadlock Docker 20.10), then the network. `before_network` (else
    `gw.before_network`): waited for between the containers' removal and the network's (the
    engine's container, removed beside them, must be off the network first). Its seconds are
    `gw.timings["gateway_remove"]`; once all is gone a spare's lock is let go (`gw.released`)."""
    from docker.errors import APIError, NotFound

    t = time.monotonic()
    boxes = [gw.container] + ([gw.netns] if gw.netns else [])
    errors = remove_in_turn(client, boxes, t + SETTLE_S, leaving=not gw.stopped)
    if (wait := before_network or gw.before_network) is not None:
        wait()
    try:
        client.api.remove_network(gw.network)
    except NotFound:
        pass
    except APIError as e:
        errors.append(f"network {gw.network}: {e}")
    try:
        if not gw.dir_gone:
            remove_dir(gw.dir)
    except OSError as e:
        errors.append(f"{gw.dir}: {e}")
    gw.timings["gateway_remove"] = round(time.monotonic() - t, 3)
    if errors:
        raise InfraError("could not remove " + "; ".join(errors), task_id=gw.job_id or None)
    if gw.released is not None:
        gw.released()


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
                remove_container(client, cid, leaving=departs(c.labels or {}, c.status))


def _not_found() -> tuple[type[BaseException], ...]:
    from docker.errors import NotFound

    return (NotFound,)


def sweep_spares(client: docker.DockerClient, root: Path, directory: Path) -> list[str]:
    """Remove the spare gateways of `root` (taken by a job or not) whose maker no longer holds
    their lock (sandbox/gateways.py): their containers, job networks, directories and locks."""
    from docker.errors import APIError

    from ..gateways import abandoned, clear_temp, forget

    flt = {"label": ["fila=1", SPARE_LABEL, f"fila.root={root}"]}
    boxes = client.api.containers(all=True, filters=flt)
    nets = client.api.networks(filters=flt)
    listed = {(x.get("Labels") or {}).get(SPARE_LABEL, "") for x in [*boxes, *nets]}
    removed = []
    for spare in sorted(abandoned(directory, listed)):
        try:
            for box in boxes:
                labels = box.get("Labels") or {}
                # One at a time, a running gateway (on fila-egress) departing: removal.py.
                leaving = departs(labels, box.get("State"))
                if labels.get(SPARE_LABEL) == spare and remove_container(client, box["Id"], leaving=leaving):
                    removed.append(f"spare gateway {box['Names'][0].lstrip('/')}")
            for net in nets:
                if (net.get("Labels") or {}).get(SPARE_LABEL) == spare:
                    with contextlib.suppress(*_not_found()):
                        client.api.remove_network(net["Id"])
                        removed.append(f"network {net['Name']}")
        except APIError as e:
            # Being removed by another (a reaper whose spare's lock file its maker unlinked on
            # the way out): what is left, the next pass finds.
            if e.status_code not in (403, 409):
                raise
            continue
        forget(directory, spare)
    return removed + clear_temp(directory)
