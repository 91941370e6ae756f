"""One job's container on the Docker API: created from `create_kwargs`, started, waited for with
the host's timeout, and always removed (docs/architecture.md, "The cycle", steps 4 and 5).

The engine is assumed hostile: the host enforces the wall-clock timeout (SIGTERM, then SIGKILL
after the grace period) and the disk limits, and removes the container also when the caller is
interrupted; what it cannot remove it says on the error (base.note_left) for recovery to find by
label. The job's files are handed to the engine and back through its Workspace (core/mounts.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import docker
import requests
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.containers import Container

from ...core.errors import EngineUnavailable, ImageMissing, InfraError
from ...core.faults import crash_point
from ...core.models import now_iso
from ...egress.config import move_dir
from ..base import Removal, RunResult, RunSpec, call_heartbeat, container_name, note_left, run_as
from . import images as docker_images
from .client import DOCKER_ERRORS, docker_client, fresh_client
from .logs import TAIL_ENTRIES, LogPump, log_frames
from .removal import remove_container
from .spec import create_kwargs, docker_runtime, has_volume, work_volume

if TYPE_CHECKING:
    from ...egress.config import Gateway
    from ..gateways import GatewayPool

_KILL_WAIT_S = 30.0  # after SIGKILL the daemon reports the exit promptly; longer means it is stuck
PUMP_WAIT_S = 10.0  # after the exit, how long the output stream may take to end before it is cut
PUMP_CUT_WAIT_S = 2.0  # after the stream's socket is shut, how long the pump may take to stop


def run(
    spec: RunSpec,
    *,
    client: docker.DockerClient | None = None,
    before_start: Callable[[str], None] | None = None,
    heartbeat: Callable[[], None] | None = None,
    heartbeat_s: float = 5.0,
    adapt: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    create: Callable[[docker.DockerClient, dict[str, Any]], Container] | None = None,
    defer_removal: bool = False,
    spares: GatewayPool | None = None,
) -> RunResult:
    """Create, start, wait (with the host's timeout), and always remove the job's container.
    `adapt` maps create_kwargs' request to another engine speaking the Docker API (Podman), and
    `create` makes the container from it (what the SDK cannot express).

    `before_start(container_id)` runs between create and start, immediately before the start:
    the side-effect boundary the caller records durably, and its last chance to refuse (raise,
    e.g. LeaseLost when its claim was reaped; the container is then removed unstarted).
    `heartbeat()` runs every `heartbeat_s` while the container runs.
    `defer_removal`: once the container has exited, its removal runs in the background on a
    connection of its own (`RunResult.removal`, for the caller to await), while work/ is handed
    back and the caller diffs it: reading work/ needs the container stopped, not gone; a job's
    gateway goes in the same removal, beside the container, its network once both are gone.
    `spares`: where a `network: allowlist` job takes a started gateway (sandbox/gateways.py)
    instead of starting its own.
    """
    client = client or docker_client()
    name = container_name(spec.job_id)
    kwargs = create_kwargs(spec, name)
    if adapt is not None:
        kwargs = adapt(kwargs)
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    uid, gid = run_as()
    host = (os.getuid(), os.getgid())
    owner = host if (uid, gid) != host else None
    if owner is not None:
        spec.workspace.hand_over(uid, gid)
    gateway: Gateway | None = None
    removal: Removal | None = None
    left: list[str] = []
    try:
        if spec.policy.runtime:
            _check_runtime(client, spec)
        if spec.policy.network == "allowlist":
            # Listening, not yet serving: its start-up runs beside the engine's (`_started`).
            gateway = start_gateway(client, spec, uid, gid, spares, early=True)
            kwargs = create_kwargs(spec, name, gateway)
            if adapt is not None:
                kwargs = adapt(kwargs)
        try:
            container = create(client, kwargs) if create is not None else client.containers.create(**kwargs)
        except ImageNotFound as e:
            raise ImageMissing(
                f"image {spec.image} is not present for job {spec.job_id}",
                hint="build it with `fila images build ENGINE`",
                task_id=spec.job_id,
            ) from e
        except DOCKER_ERRORS as e:
            raise docker_error(spec, "creating the container", e) from e
        if before_start is not None:
            before_start(container.id)
        result = _execute(
            client, spec, container, heartbeat, heartbeat_s, _started(client, spec, gateway, spares)
        )
        if spec.setup is not None and result.exit_code == 0 and not (result.timed_out or result.stopped):
            # Measured once more after the exit: a setup that writes fast and exits between two
            # heartbeats is never committed over the limit.
            result.limit_exceeded = result.limit_exceeded or _setup_over_size(client, container.id, spec)
            if not result.limit_exceeded:
                result.committed = commit_setup(client, spec, container.id)
        if gateway is not None:
            from . import egress

            egress.halt(client, gateway)
            result.egress, left = egress.read(client, gateway)
            result.gateway_timings = dict(gateway.timings)
        if defer_removal:
            removal = result.removal = _removal(client, spec, name, gateway, spares)
            gateway = None  # the removal's now
        else:
            remove_exited(client, spec, name, fresh=False)
            if gateway is not None:
                gw, gateway = gateway, None
                left += egress.remove(client, gw)
                result.gateway_timings["gateway_remove"] = gw.timings.get("gateway_remove", 0.0)
        result.warnings += spec.workspace.reclaim(owner) + left
        return result
    except BaseException as exc:
        if removal is not None:  # the container has exited and is being removed: see it through
            try:
                removal.wait()
            except Exception as e:
                note_left(exc, str(e))
            removal = None
        else:
            # Removed by name: an interrupted create may have made the container without telling us.
            _cleanup_after_failure(client, name, exc)
            if has_volume(spec):
                _remove_volume_after_failure(client, name, exc)
        if gateway is not None:
            stop_gateway_after_failure(client, gateway, exc)
        try:
            spec.workspace.reclaim(owner)
        except Exception as e:  # the original error matters more; say what is left
            note_left(exc, f"could not reclaim {spec.job_dir}: {e}", running=False)
        raise


def _started(
    client: docker.DockerClient, spec: RunSpec, gateway: Gateway | None, spares: GatewayPool | None
) -> Callable[[threading.Event], None] | None:
    """What follows the engine's start, given the event its exit sets: the pool's next spare
    asked for, and the wait for a gateway configured early to serve (the engine's connections
    wait in its queues meanwhile), ended early by the engine's exit; its log is read once
    `egress.halt` has stopped it after the engine's exit. A gateway that dies first fails the run
    (InfraError: the engine is removed with it)."""
    then: list[Callable[[threading.Event], None]] = []
    if spares is not None and spec.policy.egress is not None:
        network = spec.policy.egress.egress_network
        then.append(lambda _exited: spares.replace(network))
    if gateway is not None and not gateway.serving:
        from . import egress

        then.append(lambda exited: egress.wait_serving(client, gateway, until=exited))
    if not then:
        return None

    def started(exited: threading.Event) -> None:
        for step in then:
            step(exited)

    return started


def _execute(
    client: docker.DockerClient,
    spec: RunSpec,
    container: Container,
    heartbeat: Callable[[], None] | None,
    heartbeat_s: float,
    started: Callable[[threading.Event], None] | None = None,
) -> RunResult:
    cid = container.id
    step = "starting the container"
    warnings: list[str] = []
    try:
        started_at, t0 = now_iso(), time.monotonic()
        container.start()
        step = "streaming the container's output"
        pump = LogPump(
            lambda: log_frames(client, cid, opened=pump.sockets.append),
            spec.log_path,
            spec.policy.max_log_bytes,
            spec.redact,
            open_tail=lambda: log_frames(
                client, cid, follow=False, tail=TAIL_ENTRIES, opened=pump.sockets.append
            ),
        )
        pump.start()
        waiter = Waiter(client, cid)
        waiter.start()
        if started is not None:
            step = "starting the container"
            started(waiter.done)
        step = "waiting for the container"
        # The caller capped the timeout by policy; min() keeps that true anyway.
        deadline = t0 + min(spec.timeout_ms, spec.policy.max_timeout_ms) / 1000
        heartbeat_s = max(heartbeat_s, 0.05)
        next_beat = t0 + heartbeat_s
        timed_out = False
        limit_exceeded: str | None = None
        stopped: str | None = None  # the caller's heartbeat asked for the end (StopRun)
        grace_s = spec.policy.grace_ms / 1000
        while not waiter.done.wait(max(0.0, min(deadline, next_beat) - time.monotonic())):
            now = time.monotonic()
            if now >= deadline or stopped is not None:
                timed_out = stopped is None
                step = "stopping the container after its timeout" if timed_out else "stopping the container"
                # Our own SIGTERM/SIGKILL (not `docker stop`) so the grace period is in ms.
                _signal(client, cid, "SIGTERM")
                if not waiter.done.wait(grace_s):
                    _signal(client, cid, "SIGKILL")
                    if not waiter.done.wait(_KILL_WAIT_S):
                        raise InfraError(
                            f"container {container.name} survived SIGKILL for {_KILL_WAIT_S}s",
                            task_id=spec.job_id,
                            path=spec.log_path,
                        )
                break
            if now >= next_beat:
                reason, grace_s = call_heartbeat(heartbeat, grace_s)
                if reason is not None:
                    stopped = reason  # stopped on the next turn, as at the timeout
                    continue
                limit_exceeded = _over_disk_limits(spec) or _setup_over_size(client, cid, spec)
                if limit_exceeded:
                    step = "stopping the container after it broke a disk limit"
                    _signal(client, cid, "SIGKILL")
                    waiter.done.wait(_KILL_WAIT_S)
                    break
                next_beat = now + heartbeat_s
        ended_at, duration = now_iso(), time.monotonic() - t0
        if waiter.error is not None:
            raise waiter.error
        step = "reading the container's state"
        state = client.api.inspect_container(cid)["State"]
        pump.join(timeout=PUMP_WAIT_S)  # the output stream ends with the container
        if pump.is_alive():
            warnings.append(cut_pump(pump, spec))
        if pump.error is not None and not pump.cut:  # a read the cut ended may raise: expected
            step = "copying the container's output to its log"
            raise pump.error
    except (*DOCKER_ERRORS, OSError) as e:
        raise docker_error(spec, step, e) from e
    return RunResult(
        exit_code=state.get("ExitCode"),
        timed_out=timed_out,
        oom_killed=bool(state.get("OOMKilled")),
        started_at=started_at,
        ended_at=ended_at,
        duration_s=round(duration, 3),
        container_id=cid,
        container_name=container.name,
        image_id=container.attrs.get("Image", ""),
        log_bytes=pump.written,
        log_truncated=pump.truncated or pump.cut,
        output=pump.output(),
        limit_exceeded=limit_exceeded,
        warnings=warnings,
        stopped=stopped,
    )


def _setup_over_size(client: docker.DockerClient, cid: str, spec: RunSpec) -> str | None:
    """A setup's container past what it may write (SetupRun.max_bytes): its root file system is
    writable and becomes an image, so its size is the daemon's disk, measured by the daemon."""
    if spec.setup is None:
        return None
    size = measured(client, cid)
    if size > spec.setup.max_bytes:
        return f"the setup wrote {size} bytes, over environment.max_image_bytes {spec.setup.max_bytes}"
    return None


def measured(client: docker.DockerClient, cid: str, field: str = "SizeRw") -> int:
    """What the daemon measures of a container (the listing measures it; inspecting does not):
    `SizeRw`, what it wrote, or `SizeRootFs`, its image and what it wrote."""
    found = client.api.containers(all=True, filters={"id": cid}, size=True)
    return int((found[0] if found else {}).get(field) or 0)


def commit_setup(client: docker.DockerClient, spec: RunSpec, cid: str) -> str:
    """The exited setup container as its image (RunSpec.setup): the environment's image."""
    assert spec.setup is not None
    repo, _, tag = spec.setup.commit_tag.rpartition(":")
    try:
        out = client.api.commit(cid, repository=repo, tag=tag, changes=list(spec.setup.changes))
    except DOCKER_ERRORS as e:
        raise docker_error(spec, "committing the setup's container", e) from e
    return str(out.get("Id", ""))


class Waiter(threading.Thread):
    """Blocks on the daemon's wait endpoint so the exit is seen at once, without polling."""

    def __init__(self, client: docker.DockerClient, container_id: str) -> None:
        super().__init__(name=f"fila-wait-{container_id[:12]}", daemon=True)
        self.client, self.container_id = client, container_id
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.client.api.wait(self.container_id, timeout=None)
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


def docker_error(spec: RunSpec, action: str, err: BaseException) -> InfraError:
    """str() of the result names the job and its log: FilaError appends task_id and path."""
    cls = EngineUnavailable if isinstance(err, requests.ConnectionError) else InfraError
    hint = docker_images.RUN_HINT
    if spec.policy.runtime and "runtime" in str(err).lower():
        hint = f"install the {spec.policy.runtime!r} runtime in Docker, or change the policy's runtime"
    return cls(f"{action} failed: {err}", hint=hint, task_id=spec.job_id, path=spec.log_path)


def _signal(client: docker.DockerClient, cid: str, sig: str) -> None:
    try:
        client.api.kill(cid, signal=sig)
    except APIError as e:
        if e.status_code not in (404, 409):  # already exited or gone: what we wanted
            raise


def cut_pump(pump: LogPump, spec: RunSpec) -> str:
    """A stream that has not ended PUMP_WAIT_S after the exit (a busy daemon) is cut off rather
    than waited for without end or abandoned in silence (the fast exit would kill it mid-write):
    the log says where it ends, is fsynced, and the record gets the warning returned."""
    pump.cut_off()
    pump.join(timeout=PUMP_CUT_WAIT_S)
    what = (
        f"log incomplete: the container's output stream did not end within {PUMP_WAIT_S:g} s of its "
        "exit and was cut off; stdout and {} may miss the end of its output"
    )
    # The note in the log says "this log", never its path: a runner publishes the log byte for
    # byte (no redaction), and the path is this host's.
    with open(spec.log_path, "ab") as f:  # the pump writes nothing more (cut_off)
        f.write(f"\n[fila: {what.format('this log')}]\n".encode())
        f.flush()
        os.fsync(f.fileno())
    return what.format(spec.log_path)


def _over_disk_limits(spec: RunSpec) -> str | None:
    """Checked at every heartbeat: the job directory's size and entry count against the policy
    (max_work_bytes, max_work_files), with a margin for input/ and TASK.md."""
    p = spec.policy
    max_bytes, max_files = 2 * p.max_work_bytes + (64 << 20), 2 * p.max_work_files + 16
    used, files = spec.workspace.usage(max_bytes=max_bytes, max_files=max_files)
    if used > max_bytes:
        return f"the job directory grew past {max_bytes} bytes (2 x max_work_bytes) during the run"
    if files > max_files:
        return f"the job directory grew past {max_files} entries (2 x max_work_files) during the run"
    return None


def remove_exited(client: docker.DockerClient, spec: RunSpec, name: str, *, fresh: bool = True) -> None:
    """Remove the job's exited container and its work volume; a failure is reported as today's
    run reports it (InfraError "removing container ... failed"), after one more try on a new
    connection. `fresh`: on a connection of its own (a background removal: `client` goes back to
    its pool and serves the next request meanwhile)."""
    try:
        own = fresh_client(client) if fresh else client
    except DOCKER_ERRORS as e:
        raise docker_error(spec, f"removing container {name}", e) from e
    try:
        crash_point("during_removal")
        remove_container(own, name)
        if has_volume(spec):
            remove_volume(own, work_volume(name))
    except DOCKER_ERRORS as e:
        err = docker_error(spec, f"removing container {name}", e)
        if fresh:  # in the background: the last try a failed run makes, made here
            _cleanup_after_failure(own, name, err)
            if has_volume(spec):
                _remove_volume_after_failure(own, name, err)
        raise err from e
    finally:
        if fresh:
            own.close()


def _remove_volume_after_failure(client: docker.DockerClient, name: str, exc: BaseException) -> None:
    """The overlay strategy's work volume, on a new connection (`client` may be mid-request)."""
    try:
        fresh = fresh_client(client)
        try:
            remove_volume(fresh, work_volume(name))
        finally:
            fresh.close()
    except DOCKER_ERRORS as e:
        note_left(exc, f"could not remove volume {work_volume(name)}: {e}; `fila recover` removes it")


def remove_volume(client: docker.DockerClient, volume: str) -> None:
    with contextlib.suppress(NotFound):
        client.api.remove_volume(volume, force=True)


def _cleanup_after_failure(client: docker.DockerClient, name: str, exc: BaseException) -> None:
    for _ in range(3):
        try:
            fresh = fresh_client(client)
            try:
                remove_container(fresh, name)
            finally:
                fresh.close()
            return
        except KeyboardInterrupt:
            continue  # a second Ctrl-C must not leave a hostile engine running
        except Exception as e:
            note_left(exc, f"could not remove container {name}: {e}; `fila recover` removes it")
            return
    note_left(exc, f"container {name} may be left; `fila recover` removes it")


def _check_runtime(client: docker.DockerClient, spec: RunSpec) -> None:
    """Before any container starts (also the gateway): the runtime must be registered. Never a
    silent fallback to runc."""
    want = docker_runtime(spec.policy)
    try:
        have = client.info().get("Runtimes") or {}
    except DOCKER_ERRORS as e:
        raise docker_error(spec, "listing Docker's runtimes", e) from e
    if want not in have:
        raise InfraError(
            f"the policy's runtime {spec.policy.runtime!r} with network {spec.policy.network!r} needs "
            f"the Docker runtime {want!r}, which is not registered (have: {', '.join(sorted(have))})",
            hint=f"register the {want!r} runtime in Docker (for runsc: scripts/docker-up as root installs it "
            "and registers runsc and runsc-hostinet), or change the policy's runtime",
            task_id=spec.job_id,
        )


def _removal(
    client: docker.DockerClient, spec: RunSpec, name: str, gateway: Gateway | None, spares: GatewayPool | None
) -> Removal:
    """The exited container's removal in the background. With a gateway made for the job, the
    gateway is removed beside it, its network once the engine's container is off it. A pool's
    spare has its directory (secrets) removed here and goes back to the pool to be killed and
    removed off the job's path (egress.forget_secrets, GatewayPool.discard). What of a gateway
    cannot be removed is a warning (recovery sweeps it), as inside `run`."""
    if gateway is None:
        return Removal(name, lambda: remove_exited(client, spec, name))
    from . import egress

    gw = gateway
    timings: dict[str, float] = {}
    warnings: list[str] = []

    def both() -> None:
        failed: list[BaseException] = []

        def engine() -> None:
            try:
                remove_exited(client, spec, name)
            except BaseException as e:
                failed.append(e)

        beside = threading.Thread(target=engine, name=f"fila-remove-{name}-engine", daemon=True)
        beside.start()
        try:
            if spares is not None and gw.spare is not None:
                warnings.extend(egress.forget_secrets(gw))
                # Its containers go beside the engine's; its network once that is off it.
                gw.before_network = beside.join
                spares.discard(gw)
            else:
                own = fresh_client(client)
                try:
                    warnings.extend(egress.remove(own, gw, before_network=beside.join))
                finally:
                    own.close()
        except DOCKER_ERRORS as e:
            warnings.append(
                f"could not remove the job's gateway {gw.container}: {e}; `fila recover` removes it"
            )
        finally:
            beside.join()
            timings["gateway_remove"] = gw.timings.get("gateway_remove", 0.0)
        if failed:
            raise failed[0]

    removal = Removal(name, both)
    removal.timings, removal.warnings = timings, warnings
    return removal


def start_gateway(
    client: docker.DockerClient,
    spec: RunSpec,
    uid: int,
    gid: int,
    spares: GatewayPool | None,
    *,
    start: Callable[..., Gateway] | None = None,
    early: bool = False,
) -> Gateway:
    """A spare from `spares` made the job's, or (none there, or it failed) one started for it by
    `start` (Podman's on Podman, which waits until it serves) or egress.start. `early`: returned
    once listening, not yet serving (egress.configure; the caller then calls egress.wait_serving)."""
    from . import egress

    if spec.egress_dir is None:
        raise InfraError("network allowlist needs RunSpec.egress_dir", task_id=spec.job_id)
    if spares is not None and (gw := take_spare(client, spec, uid, gid, spares, early=early)) is not None:
        return gw
    own = (
        functools.partial(start, client)
        if start is not None
        else functools.partial(egress.start, client, early=early)
    )
    return own(
        job_id=spec.job_id, policy=spec.policy, state=spec.egress_dir, labels=spec.labels, uid=uid, gid=gid
    )


def take_spare(
    client: docker.DockerClient,
    spec: RunSpec,
    uid: int,
    gid: int,
    spares: GatewayPool,
    *,
    early: bool = False,
) -> Gateway | None:
    """The pool's spare for the job's egress network, configured for the job and ready (`early`:
    listening, see egress.configure); None when there is none or it failed (it is then removed,
    and the job starts its own). Its `timings`: gateway_take (the wait for it), gateway_ready."""
    from . import egress

    assert spec.policy.egress is not None
    t = time.monotonic()
    spare = spares.take(spec.policy.egress.egress_network)
    if spare is None:
        return None
    spare.timings["gateway_take"] = round(time.monotonic() - t, 3)
    try:
        if spec.egress_dir is not None:
            # Its directory becomes the job's (the one the quota watch reads, and recovery sweeps
            # by the job's claim); the running gateway's mounts follow the directory itself.
            move_dir(spare.dir, spec.egress_dir)
            spare.dir = spec.egress_dir
        return egress.configure(
            client, spare, job_id=spec.job_id, policy=spec.policy, uid=uid, gid=gid, early=early
        )
    except (InfraError, OSError) as e:  # a spare that died meanwhile
        spares.errors.append(f"spare gateway {spare.container} failed for {spec.job_id}: {e}")
        with contextlib.suppress(InfraError):
            egress.stop(client, spare)  # configure removed it already, unless the move failed
        return None


def stop_gateway_after_failure(client: docker.DockerClient, gateway: Gateway, exc: BaseException) -> None:
    from . import egress

    try:
        fresh = fresh_client(client)
        try:
            egress.stop(fresh, gateway)
        finally:
            fresh.close()
    except Exception as e:
        note_left(exc, f"could not remove the job's gateway or network: {e}; `fila recover` sweeps them")
