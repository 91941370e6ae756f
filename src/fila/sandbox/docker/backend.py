"""The Docker backend: one job's container through the Docker SDK, hardened as docs/architecture.md
asks, and removed.

The engine is assumed hostile: it sees the job directory (input/ read-only) and nothing else of
the host, no network unless the policy says so, and limits on memory, cpu, pids, files and time.
The host enforces the wall-clock timeout (SIGTERM, then SIGKILL after the grace period) and always
removes the container, also when the caller is interrupted; labels let a later sweep find
containers a killed fila left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import docker
import requests
from docker.constants import STREAM_HEADER_SIZE_BYTES
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import DriverConfig, LogConfig, Mount, Ulimit
from docker.utils.socket import STDERR, STDOUT

from ...core import fsutil
from ...core.errors import EngineUnavailable, ImageMissing, InfraError, InvalidPolicy
from ...core.faults import crash_point
from ...core.models import ImageRef, Limits, Policy, now_iso, parse_size
from ...engines.base import HOME, JOB_MOUNT
from ...workspace import jobdir, secretscan
from ..base import (
    JOB_LABEL,
    LABEL,
    ROOT_LABEL,
    STDERR_TAIL,
    UNPRIVILEGED,
    Backend,
    Box,
    ImageInfo,
    Removal,
    RunOutput,
    RunResult,
    RunSpec,
    container_name,
    note_left,
    run_as,
)
from . import images as docker_images

__all__ = ["UNPRIVILEGED", "DockerBackend", "RunResult", "RunSpec", "create_kwargs", "docker_client"]
_DOCKER_ERRORS = (DockerException, requests.RequestException)
_KILL_WAIT_S = 30.0  # after SIGKILL the daemon reports the exit promptly; longer means it is stuck
TAIL_ENTRIES = 16  # log entries read again after the followed stream ends (see _LogPump)
PUMP_WAIT_S = 10.0  # after the exit, how long the output stream may take to end before it is cut
PUMP_CUT_WAIT_S = 2.0  # after the stream's socket is shut, how long the pump may take to stop
SEEN_KEEP = 1 << 20  # each stream's last raw bytes the pump keeps to align that tail


def docker_client(
    timeout: float = 60, *, version: str | None = None, check: bool = True
) -> docker.DockerClient:
    """A client for the local daemon (DOCKER_HOST honoured), checked: without `version`, by its
    first request (GET /version, the API version it then speaks: a ping would only repeat that
    the daemon answers); with one, by a ping unless not `check` (then it asks nothing)."""
    client = None
    try:
        client = docker.from_env(timeout=timeout, version=version)
        if version is not None and check:
            client.ping()
        return client
    except _DOCKER_ERRORS as e:
        if client is not None:
            client.close()
        denied = "Permission denied" in str(e)
        raise EngineUnavailable(
            f"the Docker daemon does not answer: {e}",
            hint="add your user to the docker group (or use rootless Docker)"
            if denied
            else "start Docker (e.g. `systemctl start docker`) or set DOCKER_HOST",
        ) from e


def _fresh_client(client: docker.DockerClient) -> docker.DockerClient:
    """A new connection to the same daemon: the interrupted client may be mid-request."""
    adapter = client.api.get_adapter(client.api.base_url)
    socket_path = getattr(adapter, "socket_path", None)
    if socket_path:
        return docker.DockerClient(
            base_url=f"unix://{socket_path}", version=client.api.api_version, timeout=30
        )
    return docker.from_env(version=client.api.api_version, timeout=30)


def _effective(policy: Policy, limits: Limits | None) -> tuple[int, float, int]:
    """memory bytes, cpus, pids. The caller checked limits <= policy; min() keeps that true anyway."""
    mem, cpus, pids = parse_size(policy.memory), policy.cpus, policy.pids
    if limits is not None:
        mem = min(mem, parse_size(limits.memory)) if limits.memory is not None else mem
        cpus = min(cpus, limits.cpus) if limits.cpus is not None else cpus
        pids = min(pids, limits.pids) if limits.pids is not None else pids
    return mem, cpus, pids


def _check_limits(kw: dict[str, Any], policy: Policy) -> None:
    """The last look at what reaches Docker: every limit > 0 (0 and -1 read as "unlimited") and
    within the policy, whatever the models let through. A policy is input too."""
    from ...core.models import MIN_CPUS, MIN_MEMORY, MIN_PIDS, MIN_SIZE

    mem = parse_size(policy.memory)
    fsize = parse_size(policy.fsize)
    tmp_caps = {"/tmp": parse_size(policy.tmpfs.tmp), HOME: parse_size(policy.tmpfs.home)}
    tmpfs = []  # a tmpfs without size= gets half the host's memory: refused like size=0
    for target, opts in kw.get("tmpfs", {}).items():
        size = re.search(r"(?:^|,)size=([0-9]+)(?:,|$)", opts)
        cap = tmp_caps.get(target, max(tmp_caps.values()))
        tmpfs.append((f"tmpfs {target}", int(size.group(1)) if size else None, MIN_SIZE, cap))
    checks = [
        ("memory", kw["mem_limit"], MIN_MEMORY, mem),
        ("memory swap", kw["memswap_limit"], MIN_MEMORY, mem),
        ("cpus", kw["nano_cpus"], int(MIN_CPUS * 1e9), int(policy.cpus * 1e9)),
        ("pids", kw["pids_limit"], MIN_PIDS, policy.pids),
        *((f"ulimit {u['Name']}", u["Hard"], 1, policy.nofile if u["Name"] == "nofile" else fsize)
          for u in kw["ulimits"]),
        *((f"ulimit {u['Name']} (soft)", u["Soft"], 1, u["Hard"]) for u in kw["ulimits"]),
        *tmpfs,
    ]  # fmt: skip
    for what, value, floor, cap in checks:
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 < floor <= value <= cap):
            raise InvalidPolicy(
                f"container {what} would be {value!r}: allowed {floor} to {cap}",
                hint="fix the policy or the task's limits: 0 and tiny values mean no limit to Docker",
            )


def create_kwargs(spec: RunSpec, name: str, gateway: Any = None) -> dict[str, Any]:
    """Everything the container is created with. The image controls none of the entrypoint,
    command, user or workdir (runc CVE-2024-21626 was a workdir trick); its ENV only fills the
    names `spec.env` leaves unset, and never comes from the host."""
    if not spec.argv:
        raise ValueError("RunSpec.argv is empty")
    job_dir = spec.job_dir.resolve()
    input_dir, work_dir = job_dir / "input", job_dir / "work"
    ov = spec.overlay
    if not job_dir.is_dir():
        raise InfraError("the job directory is missing", task_id=spec.job_id, path=job_dir)
    for sub in (input_dir, work_dir):
        if sub.is_symlink() or not sub.is_dir():
            raise InfraError(f"the job's {sub.name}/ is not a directory", task_id=spec.job_id, path=sub)
    p = spec.policy
    mem, cpus, pids = _effective(p, spec.limits)
    uid, gid = run_as()
    fsize = parse_size(p.fsize)
    # exec: engines run tools from /tmp and HOME (npm, pip builds); the work/ bind allows it anyway.
    tmp_opts = f"rw,nosuid,nodev,exec,size={parse_size(p.tmpfs.tmp)},mode=1777"
    home_opts = f"rw,nosuid,nodev,exec,size={parse_size(p.tmpfs.home)},uid={uid},gid={gid},mode=0700"
    # The daemon keeps its own copy of the output; capped so a log bomb cannot fill its disk.
    daemon_log = str(max(2 * p.max_log_bytes, 1 << 20))
    kwargs: dict[str, Any] = dict(
        image=spec.image,
        name=name,
        entrypoint=spec.argv[:1],
        command=spec.argv[1:],
        environment={**spec.env, "HOME": HOME},
        working_dir=JOB_MOUNT,
        user=f"{uid}:{gid}",
        hostname="fila",
        labels={**spec.labels, LABEL: "1", JOB_LABEL: spec.job_id}
        | ({VOLUME_LABEL: work_volume(name)} if ov is not None else {}),
        # Only work/ is writable, whoever the engine runs as: with the host user's uid (fila not
        # run as root) the engine owns the job directory, and only the mount keeps it from
        # rewriting TASK.md or leaving files beside work/ (the host would read them later).
        mounts=[
            Mount(JOB_MOUNT, str(job_dir), type="bind", read_only=True),
            Mount(f"{JOB_MOUNT}/input", str(input_dir), type="bind", read_only=True),
            Mount(f"{JOB_MOUNT}/work", str(work_dir), type="bind", read_only=False),
        ]
        if ov is None
        else [
            # The overlay strategy: input/ is the shared snapshot, read-only; work/ the job's
            # overlay volume (its upper layer alone takes writes; the daemon mounts it).
            Mount(JOB_MOUNT, str(job_dir), type="bind", read_only=True),
            Mount(f"{JOB_MOUNT}/input", str(ov.lower), type="bind", read_only=True),
            _work_mount(spec, name),
        ],
        network_mode=p.network if p.network != "allowlist" else "none",
        mem_limit=mem,
        memswap_limit=mem,
        nano_cpus=int(cpus * 1e9),
        pids_limit=pids,
        ulimits=[
            Ulimit(name="nofile", soft=p.nofile, hard=p.nofile),
            Ulimit(name="fsize", soft=fsize, hard=fsize),
        ],
        read_only=True,
        tmpfs={"/tmp": tmp_opts, HOME: home_opts},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        init=True,
        ipc_mode="private",
        oom_score_adj=500,  # under host-wide memory pressure the engine dies before the host's
        stop_signal="SIGTERM",
        log_config=LogConfig(type=LogConfig.types.JSON, config={"max-size": daemon_log, "max-file": "3"}),
        stdin_open=False,
        tty=False,
    )
    if p.runtime:
        kwargs["runtime"] = docker_runtime(p)
    if p.network == "allowlist" and gateway is not None:  # without one: no network at all
        # The job network only: the gateway is the engine's proxy, resolver and model routes.
        kwargs["network_mode"] = gateway.network
        kwargs["dns"] = [gateway.ip]
        # The gateway's values win: a real key forwarded by an adapter never replaces the placeholder.
        kwargs["environment"] = {**kwargs["environment"], **gateway.engine_env()}
    _check_limits(kwargs, p)
    return kwargs


def _redactor(values: list[str]) -> secretscan.StreamMasker:
    """The log's redactor: each known credential and its usual encodings (secretscan), as ***."""
    return secretscan.Scanner(secretscan.Credential("", v) for v in values).stream(lambda _label: b"***")


def _log_frames(
    client: docker.DockerClient,
    cid: str,
    *,
    follow: bool = True,
    tail: int | str = "all",
    opened: Callable[[Any], None] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """The container's output as (stream, bytes) frames, stdout (1) apart from stderr (2), as
    they come. The SDK's logs() drops the frame header's stream byte (its demux is for attach and
    exec only), so this is its own stream helper with the stream kept: the request, the socket
    without a read timeout, then the 8-byte header (stream, size) of each frame. `opened` gets
    the socket, so another thread can shut it and end a read that would otherwise never return."""
    api = client.api
    params = {"stdout": 1, "stderr": 1, "follow": int(follow), "timestamps": 0, "tail": tail}
    res = api._get(api._url("/containers/{0}/logs", cid), params=params, stream=True)
    try:
        api._raise_for_status(res)
        sock = api._get_raw_response_socket(res)
        api._disable_socket_timeout(sock)
        if opened is not None:
            opened(sock)
        while True:
            header = res.raw.read(STREAM_HEADER_SIZE_BYTES)
            if len(header) < STREAM_HEADER_SIZE_BYTES:
                return
            stream, length = struct.unpack(">BxxxL", header)
            data = res.raw.read(length) if length else b""
            if length and not data:
                return
            yield stream, data
    finally:
        res.close()


class _LogPump(threading.Thread):
    """Copies the container's output to the log file as it comes (progress for long work), both
    streams interleaved as they came, and keeps them apart for classification (RunOutput):
    stdout up to the log's cap, stderr's last STDERR_TAIL bytes. Each stream has its own
    redactor, so a secret split across two frames of one stream is still caught.

    `open_stream` is called in this thread: Podman answers a follow request only once the
    container prints something, and a silent engine must not hold up the host's timeout and the
    heartbeat, which run in the caller's thread meanwhile.

    `open_tail` reads the last TAIL_ENTRIES entries once the followed stream has ended: Docker 20.10
    was seen to end a follow request before the container's last output reached it (a final line
    without a newline, e.g. gemini's closing `}`); what the tail has beyond what was seen is added.

    `cut_off` ends a stream that did not end with the container (a busy daemon): from then on
    nothing more is copied, and stdout counts as truncated (classification must not read a part
    as the whole). The log file is fsynced before the pump ends: the record points at it."""

    def __init__(
        self,
        open_stream: Callable[[], Iterable[tuple[int, bytes]]],
        path: Path,
        cap: int,
        redact: list[str],
        open_tail: Callable[[], Iterable[tuple[int, bytes]]] | None = None,
    ) -> None:
        super().__init__(name=f"fila-log-{path.name}", daemon=True)
        self.open_stream, self.path, self.cap, self.open_tail = open_stream, path, cap, open_tail
        self.seen = {STDOUT: bytearray(), STDERR: bytearray()}  # each stream's raw end, to align the tail
        self.stream: Iterable[tuple[int, bytes]] = ()
        self.redactors = {STDOUT: _redactor(redact), STDERR: _redactor(redact)}
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.stderr_dropped = False
        self.written = 0
        self.truncated = False
        self.cut = False  # the stream was cut off after the exit: what was copied is a part
        self.lock = threading.Lock()  # no write lands after cut_off returns
        self.sockets: list[Any] = []  # the open streams' sockets (`_log_frames`'s `opened`)
        self.error: BaseException | None = None

    def cut_off(self) -> None:
        """Stop copying (called from another thread), then shut the stream's socket so a read
        blocked on it returns."""
        with self.lock:
            self.cut = True
        for sock in list(self.sockets):
            with contextlib.suppress(OSError, AttributeError):
                getattr(sock, "_sock", sock).shutdown(socket.SHUT_RDWR)

    def _write(self, f: Any, stream: int, data: bytes) -> None:
        with self.lock:
            if not self.cut:
                self._write_locked(f, stream, data)

    def _write_locked(self, f: Any, stream: int, data: bytes) -> None:
        room = self.cap - self.written
        if len(data) > room:
            data, self.truncated = data[:room], True
        f.write(data)
        f.flush()
        self.written += len(data)
        if stream == STDOUT:
            self.stdout += data  # within the log's cap, so never more than it
        else:
            self.stderr += data
            if len(self.stderr) > STDERR_TAIL:
                del self.stderr[: len(self.stderr) - STDERR_TAIL]
                self.stderr_dropped = True

    def _copy(self, f: Any, stream: int, chunk: bytes) -> None:
        seen = self.seen[stream]
        seen += chunk
        if len(seen) > SEEN_KEEP:
            del seen[: len(seen) - SEEN_KEEP]
        if not self.truncated:
            self._write(f, stream, self.redactors[stream].feed(chunk))

    def _missed(self) -> list[tuple[int, bytes]]:
        """The entries of the log's tail after the longest run of them that ends what was seen."""
        if self.open_tail is None or self.cut:
            return []
        entries: dict[int, list[bytes]] = {STDOUT: [], STDERR: []}
        try:
            for stream, chunk in self.open_tail():
                if stream in entries:
                    entries[stream].append(chunk)
        except _DOCKER_ERRORS:
            return []  # best effort: the followed stream already gave the run's output
        missed = []
        for stream, got in entries.items():
            seen = bytes(self.seen[stream])
            for j in range(len(got), 0 if seen else -1, -1):
                if seen.endswith(b"".join(got[:j])):
                    missed += [(stream, chunk) for chunk in got[j:]]
                    break
        return missed

    def output(self) -> RunOutput:
        return RunOutput(
            stdout=bytes(self.stdout),
            stderr=bytes(self.stderr),
            stdout_truncated=self.truncated or self.cut,
            stderr_truncated=self.stderr_dropped or self.cut,
        )

    def run(self) -> None:
        try:
            with open(self.path, "wb") as f:
                fsutil.fsync_dir(self.path.parent)  # the record will point at this file
                self.stream = self.open_stream()
                for stream, chunk in self.stream:
                    if stream not in self.redactors:
                        continue  # stdin's stream id: the engine has no stdin
                    self._copy(f, stream, chunk)
                    if self.truncated or self.cut:
                        break  # stop reading: a log bomb must not cost us the rest of it
                else:
                    for stream, chunk in self._missed():
                        self._copy(f, stream, chunk)
                    for stream, redactor in self.redactors.items():
                        self._write(f, stream, redactor.flush())
                with self.lock:
                    if self.truncated and not self.cut:
                        f.write(f"\n[fila: log truncated at {self.cap} bytes]\n".encode())
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as e:  # reported by run(); a thread cannot raise to its caller
            self.error = e
        finally:
            close = getattr(self.stream, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):  # already broken: nothing left to release
                    close()


class _Waiter(threading.Thread):
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


def _docker_error(spec: RunSpec, action: str, err: BaseException) -> InfraError:
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


def _execute(
    client: docker.DockerClient,
    spec: RunSpec,
    container: Container,
    heartbeat: Callable[[], None] | None,
    heartbeat_s: float,
) -> RunResult:
    cid = container.id
    step = "starting the container"
    warnings: list[str] = []
    try:
        started_at, t0 = now_iso(), time.monotonic()
        container.start()
        step = "streaming the container's output"
        pump = _LogPump(
            lambda: _log_frames(client, cid, opened=pump.sockets.append),
            spec.log_path,
            spec.policy.max_log_bytes,
            spec.redact,
            open_tail=lambda: _log_frames(
                client, cid, follow=False, tail=TAIL_ENTRIES, opened=pump.sockets.append
            ),
        )
        pump.start()
        waiter = _Waiter(client, cid)
        waiter.start()
        step = "waiting for the container"
        # The caller capped the timeout by policy; min() keeps that true anyway.
        deadline = t0 + min(spec.timeout_ms, spec.policy.max_timeout_ms) / 1000
        heartbeat_s = max(heartbeat_s, 0.05)
        next_beat = t0 + heartbeat_s
        timed_out = False
        limit_exceeded: str | None = None
        while not waiter.done.wait(max(0.0, min(deadline, next_beat) - time.monotonic())):
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                step = "stopping the container after its timeout"
                # Our own SIGTERM/SIGKILL (not `docker stop`) so the grace period is in ms.
                _signal(client, cid, "SIGTERM")
                if not waiter.done.wait(spec.policy.grace_ms / 1000):
                    _signal(client, cid, "SIGKILL")
                    if not waiter.done.wait(_KILL_WAIT_S):
                        raise InfraError(
                            f"container {container.name} survived SIGKILL for {_KILL_WAIT_S}s",
                            task_id=spec.job_id,
                            path=spec.log_path,
                        )
                break
            if now >= next_beat:
                if heartbeat is not None:
                    heartbeat()
                limit_exceeded = _over_disk_limits(spec)
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
            warnings.append(_cut_pump(pump, spec))
        if pump.error is not None and not pump.cut:  # a read the cut ended may raise: expected
            step = "copying the container's output to its log"
            raise pump.error
    except (*_DOCKER_ERRORS, OSError) as e:
        raise _docker_error(spec, step, e) from e
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
    )


def _cut_pump(pump: _LogPump, spec: RunSpec) -> str:
    """A stream that has not ended PUMP_WAIT_S after the exit (a busy daemon) is cut off rather
    than waited for without end or abandoned in silence (the fast exit would kill it mid-write):
    the log says where it ends, is fsynced, and the record gets the warning returned."""
    pump.cut_off()
    pump.join(timeout=PUMP_CUT_WAIT_S)
    what = (
        f"log incomplete: the container's output stream did not end within {PUMP_WAIT_S:g} s of its "
        f"exit and was cut off; stdout and {spec.log_path} may miss the end of its output"
    )
    with open(spec.log_path, "ab") as f:  # the pump writes nothing more (cut_off)
        f.write(f"\n[fila: {what}]\n".encode())
        f.flush()
        os.fsync(f.fileno())
    return what


def _over_disk_limits(spec: RunSpec) -> str | None:
    """Checked at every heartbeat: the job directory's size and entry count against the policy
    (max_work_bytes, max_work_files), with a margin for input/ and TASK.md."""
    p = spec.policy
    max_bytes, max_files = 2 * p.max_work_bytes + (64 << 20), 2 * p.max_work_files + 16
    used, files = jobdir.usage(spec.job_dir, max_bytes=max_bytes, max_files=max_files)
    if spec.overlay is not None:  # what the engine writes lands in the upper layer
        more = jobdir.usage(spec.overlay.upper, max_bytes=max_bytes - used, max_files=max_files - files)
        used, files = used + more[0], files + more[1]
    if used > max_bytes:
        return f"the job directory grew past {max_bytes} bytes (2 x max_work_bytes) during the run"
    if files > max_files:
        return f"the job directory grew past {max_files} entries (2 x max_work_files) during the run"
    return None


def _remove_exited(client: docker.DockerClient, spec: RunSpec, name: str, *, fresh: bool = True) -> None:
    """Remove the job's exited container and its work volume; a failure is reported as today's
    run reports it (InfraError "removing container ... failed"), after one more try on a new
    connection. `fresh`: on a connection of its own (a background removal: `client` goes back to
    its pool and serves the next request meanwhile)."""
    try:
        own = _fresh_client(client) if fresh else client
    except _DOCKER_ERRORS as e:
        raise _docker_error(spec, f"removing container {name}", e) from e
    try:
        crash_point("during_removal")
        _remove(own, name)
        if spec.overlay is not None:
            _remove_volume(own, work_volume(name))
    except _DOCKER_ERRORS as e:
        err = _docker_error(spec, f"removing container {name}", e)
        if fresh:  # in the background: the last try a failed run makes, made here
            _cleanup_after_failure(own, name, err)
            if spec.overlay is not None:
                _remove_volume_after_failure(own, name, err)
        raise err from e
    finally:
        if fresh:
            own.close()


def _remove_volume_after_failure(client: docker.DockerClient, name: str, exc: BaseException) -> None:
    """The overlay strategy's work volume, on a new connection (`client` may be mid-request)."""
    try:
        fresh = _fresh_client(client)
        try:
            _remove_volume(fresh, work_volume(name))
        finally:
            fresh.close()
    except _DOCKER_ERRORS as e:
        note_left(exc, f"could not remove volume {work_volume(name)}: {e}; `fila recover` removes it")


def _remove(client: docker.DockerClient, name: str) -> None:
    try:
        client.api.remove_container(name, force=True, v=True)
    except NotFound:
        pass
    except APIError as e:
        if e.status_code == 409 and "already in progress" in str(e):
            return
        raise


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
    back and the caller diffs it: reading work/ needs the container stopped, not gone.
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
        jobdir.hand_over(spec.job_dir, uid, gid)
    gateway = None
    removal: Removal | None = None
    left: list[str] = []
    try:
        if spec.policy.runtime:
            _check_runtime(client, spec)
        if spec.policy.network == "allowlist":
            gateway = _start_gateway(client, spec, uid, gid)
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
        except _DOCKER_ERRORS as e:
            raise _docker_error(spec, "creating the container", e) from e
        if before_start is not None:
            before_start(container.id)
        result = _execute(client, spec, container, heartbeat, heartbeat_s)
        # With a gateway, its network can go only once the job's container is gone: removed now.
        if defer_removal and gateway is None:
            removal = result.removal = Removal(name, lambda: _remove_exited(client, spec, name))
        else:
            _remove_exited(client, spec, name, fresh=False)
        if gateway is not None:
            from . import egress

            gw, gateway = gateway, None
            result.egress, left = egress.finish(client, gw)
        result.warnings += jobdir.reclaim(spec.job_dir, owner=owner) + left
        if spec.overlay is not None:
            result.warnings += jobdir.reclaim_tree(spec.overlay.upper, owner=owner)
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
            if spec.overlay is not None:
                _remove_volume_after_failure(client, name, exc)
        if gateway is not None:
            stop_gateway_after_failure(client, gateway, exc)
        try:
            jobdir.reclaim(spec.job_dir, owner=owner)
        except Exception as e:  # the original error matters more; say what is left
            note_left(exc, f"could not reclaim {spec.job_dir}: {e}", running=False)
        raise


def docker_runtime(policy: Policy) -> str:
    """The Docker runtime of a policy. gVisor is registered twice (scripts/docker-up): `runsc`
    with --network=none, and `runsc-hostinet` whose gVisor uses the container's own network
    namespace (the job network), since its netstack cannot start on this kind of host."""
    if policy.runtime == "runsc" and policy.network != "none":
        return "runsc-hostinet"
    return str(policy.runtime)


def _check_runtime(client: docker.DockerClient, spec: RunSpec) -> None:
    """Before any container starts (also the gateway): the runtime must be registered. Never a
    silent fallback to runc."""
    want = docker_runtime(spec.policy)
    try:
        have = client.info().get("Runtimes") or {}
    except _DOCKER_ERRORS as e:
        raise _docker_error(spec, "listing Docker's runtimes", e) from e
    if want not in have:
        raise InfraError(
            f"the policy's runtime {spec.policy.runtime!r} with network {spec.policy.network!r} needs "
            f"the Docker runtime {want!r}, which is not registered (have: {', '.join(sorted(have))})",
            hint=f"register the {want!r} runtime in Docker (for runsc: scripts/docker-up as root installs it "
            "and registers runsc and runsc-hostinet), or change the policy's runtime",
            task_id=spec.job_id,
        )


def _start_gateway(client: docker.DockerClient, spec: RunSpec, uid: int, gid: int) -> Any:
    from . import egress

    if spec.egress_dir is None:
        raise InfraError("network allowlist needs RunSpec.egress_dir", task_id=spec.job_id)
    return egress.start(
        client,
        job_id=spec.job_id,
        policy=spec.policy,
        state=spec.egress_dir,
        labels=spec.labels,
        uid=uid,
        gid=gid,
    )


def stop_gateway_after_failure(client: docker.DockerClient, gateway: Any, exc: BaseException) -> None:
    from . import egress

    try:
        fresh = _fresh_client(client)
        try:
            egress.stop(fresh, gateway)
        finally:
            fresh.close()
    except Exception as e:
        note_left(exc, f"could not remove the job's gateway or network: {e}; `fila recover` sweeps them")


VOLUME_LABEL = "fila.volume"  # on a container whose work/ is an overlay volume: the volume's name


def work_volume(container: str) -> str:
    return f"{container}-work"


def _work_mount(spec: RunSpec, name: str) -> Mount:
    """The job's work/ as a `local` volume of type overlay, made by the daemon with the container
    (one request: no volume without its container) and mounted by it, so fila needs no mount
    privilege. `userxattr`: the opaque-directory marks are user.* xattrs the host reads without
    privilege; redirect_dir and metacopy stay off (their default with it), so a renamed directory
    is copied and every changed file is whole in the upper layer. no_copy: nothing of the image
    is copied into it."""
    return Mount(
        f"{JOB_MOUNT}/work",
        work_volume(name),
        type="volume",
        read_only=False,
        no_copy=True,
        labels={**spec.labels, LABEL: "1", JOB_LABEL: spec.job_id},
        driver_config=DriverConfig(
            "local", options={"type": "overlay", "device": "overlay", "o": spec.overlay.mount_options()}
        ),
    )


def _remove_volume(client: docker.DockerClient, volume: str) -> None:
    with contextlib.suppress(NotFound):
        client.api.remove_volume(volume, force=True)


def _cleanup_after_failure(client: docker.DockerClient, name: str, exc: BaseException) -> None:
    for _ in range(3):
        try:
            fresh = _fresh_client(client)
            try:
                _remove(fresh, name)
            finally:
                fresh.close()
            return
        except KeyboardInterrupt:
            continue  # a second Ctrl-C must not leave a hostile engine running
        except Exception as e:
            note_left(exc, f"could not remove container {name}: {e}; `fila recover` removes it")
            return
    note_left(exc, f"container {name} may be left; `fila recover` removes it")


def _label_filters(job_id: str | None, root: str | None) -> dict[str, list[str]]:
    labels = [f"{LABEL}=1"]
    if job_id is not None:
        labels.append(f"{JOB_LABEL}={job_id}")
    if root is not None:
        labels.append(f"{ROOT_LABEL}={root}")
    return {"label": labels}


def find_containers(
    client: docker.DockerClient, *, job_id: str | None = None, root: str | None = None
) -> list[Container]:
    """fila's containers in any state, by label (of one job, one queue root, or all)."""
    try:
        return client.containers.list(all=True, filters=_label_filters(job_id, root), ignore_removed=True)
    except _DOCKER_ERRORS as e:
        raise InfraError(f"Docker failed while listing fila's containers: {e}") from e


def remove_containers(
    client: docker.DockerClient, *, job_id: str | None = None, root: str | None = None
) -> list[str]:
    """Force-remove fila's containers by label; returns the ids removed."""
    removed = []
    for c in find_containers(client, job_id=job_id, root=root):
        try:
            _remove(client, c.id)
        except _DOCKER_ERRORS as e:
            raise InfraError(f"Docker failed while removing container {c.name}: {e}") from e
        removed.append(c.id)
    return removed


def _overlay_check(backend: DockerBackend) -> str | None:
    try:
        if "\toverlay\n" not in Path("/proc/filesystems").read_text():
            return "this kernel has no overlay filesystem"
    except OSError:
        return "this host has no /proc/filesystems (not Linux): no overlay filesystem"
    try:
        with backend.client() as c:
            info = c.info()
    except (*_DOCKER_ERRORS, EngineUnavailable) as e:
        return f"the {backend.name} daemon did not say whether it can mount overlay volumes: {e}"
    if info.get("OSType") not in (None, "linux"):
        return f"the {backend.name} daemon runs {info.get('OSType')}, not Linux"
    rootless = any("rootless" in str(o) for o in info.get("SecurityOptions") or [])
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if rootless and (release is None or (int(release[1]), int(release[2])) < (5, 11)):
        return (
            f"rootless {backend.name} on kernel {os.uname().release} cannot mount overlay "
            "(it needs 5.11+, or fuse-overlayfs)"
        )
    return None


class DockerBackend(Backend):
    """Docker (the default). Clients are pooled here, one per concurrent job at most: a new client
    and its ping cost ~8 ms a task, and one job's calls never wait for another's. A client that
    saw an error is closed, never reused. `client` (tests, `fila run` with a given client) is used
    for every call and never closed.

    The daemon is asked its API version once (the first client's GET /version); later clients
    reuse it. A ping is skipped while the daemon answered within FRESH_S (a request that worked,
    or a ping): it would only say so again. Any error forgets that, so the next ping asks."""

    name = "docker"
    POOL_MAX = 16
    FRESH_S = 2.0

    def __init__(self, client: docker.DockerClient | None = None, *, timeout: float = 60) -> None:
        self._given = client
        self._timeout = timeout
        self._pool: list[docker.DockerClient] = []
        self._lock = threading.Lock()
        self._overlay_why: list[str | None] | None = None
        self._overlay_lock = threading.Lock()
        self._version: str | None = None
        self._answered_at = -self.FRESH_S - 1.0  # never

    # -- connections ------------------------------------------------------------------------

    def _answered(self, ok: bool = True) -> None:
        self._answered_at = time.monotonic() if ok else -self.FRESH_S - 1.0  # an error: ask again

    def _fresh(self) -> bool:
        return time.monotonic() - self._answered_at < self.FRESH_S

    def connect(self, timeout: float | None = None) -> docker.DockerClient:
        """A new client, checked (EngineUnavailable when the daemon does not answer): the first by
        asking the daemon's API version, a later one by a ping unless the daemon just answered."""
        t = self._timeout if timeout is None else timeout
        try:
            c = docker_client(t, version=self._version, check=not self._fresh())
        except EngineUnavailable:
            self._answered(False)
            raise
        self._version = self._version or c.api.api_version
        self._answered()
        return c

    @contextlib.contextmanager
    def client(self) -> Iterator[docker.DockerClient]:
        """A client for the duration of the block: from the pool, or new."""
        if self._given is not None:
            yield self._given
            return
        with self._lock:
            c = self._pool.pop() if self._pool else None
        if c is None:
            c = self.connect()
        healthy = False
        try:
            yield c
            healthy = True
        finally:
            self._answered(healthy)
            keep = False
            if healthy:
                with self._lock:
                    if len(self._pool) < self.POOL_MAX:
                        self._pool.append(c)
                        keep = True
            if not keep:
                with contextlib.suppress(Exception):
                    c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._pool = self._pool, []
        for c in idle:
            with contextlib.suppress(Exception):
                c.close()

    def ping(self) -> None:
        if self._given is not None:
            try:
                self._given.ping()
            except _DOCKER_ERRORS as e:
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
            return
        if self._fresh():
            return  # it answered a moment ago (one ping a process, not one per job and recovery)
        with self._lock:
            c = self._pool.pop() if self._pool else None
        if c is None:
            # A new client is checked (15 s: a hung daemon is reported soon), then pooled with
            # the usual timeout: the job that follows uses this connection.
            c = self.connect(timeout=15)
            c.api.timeout = self._timeout
        else:
            try:
                c.api.get(f"{c.api.base_url}/_ping", timeout=15).raise_for_status()
            except _DOCKER_ERRORS as e:
                self._answered(False)
                with contextlib.suppress(Exception):
                    c.close()  # a client that saw an error is never reused
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
            self._answered()
        with self._lock:
            if len(self._pool) < self.POOL_MAX:
                self._pool.append(c)
                return
        c.close()

    # -- the seam -----------------------------------------------------------------------------

    def unenforceable(self, policy: Policy) -> list[str]:
        return []  # the daemon runs as root with cgroups: every limit create_kwargs sets holds

    def overlay_unsupported(self) -> str | None:
        """Measured once: the kernel must have overlayfs, and a rootless daemon (in a user
        namespace) needs a kernel that mounts overlay there (5.11+; else fuse-overlayfs)."""
        if self._overlay_why is None:
            with self._overlay_lock:  # a worker asks early, in the background: one /info a backend
                if self._overlay_why is None:
                    self._overlay_why = [_overlay_check(self)]
        return self._overlay_why[0]

    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        waived = self.check(spec.policy, job_id=spec.job_id)
        with self.client() as c:
            result = run(
                spec,
                client=c,
                before_start=before_start,
                heartbeat=heartbeat,
                heartbeat_s=heartbeat_s,
                defer_removal=spec.defer_removal,
            )
        result.backend, result.waived = self.name, waived
        return result

    def build(
        self,
        engine: str,
        *,
        base: str | None = None,
        ca_file: Path | None = None,
        force: bool = False,
        progress: Callable[[str], None] = print,
        verbose: bool = False,
    ) -> ImageRef:
        from .. import images

        return images.build(
            engine, self, base=base, ca_file=ca_file, force=force, progress=progress, verbose=verbose
        )

    def ensure_image(self, engine: str, *, progress: Callable[[str], None] = print) -> ImageRef:
        from .. import images

        return images.ensure_image(engine, self, progress=progress)

    # Build networking: none for a build on Podman (rootless networking needs a usable tun);
    # Docker's default for Docker.
    build_network: str | None = None

    def image_info(self, tag: str) -> ImageInfo | None:
        with self.client() as c:
            return docker_images.image_info(c, tag, engine=self.name)

    def build_context(
        self,
        context: Path,
        tag: str,
        *,
        buildargs: dict[str, str],
        labels: dict[str, str],
        nocache: bool,
        progress: Callable[[str], None],
    ) -> None:
        with self.client() as c:
            docker_images.build_context(
                c,
                context,
                tag,
                buildargs=buildargs,
                labels=labels,
                nocache=nocache,
                progress=progress,
                engine=self.name,
                network_mode=self.build_network,
            )

    def import_image(self, archive: Path, tag: str, changes: list[str]) -> None:
        with self.client() as c:
            docker_images.import_image(c, archive, tag, changes, engine=self.name)

    def pull(self, image: str) -> str | None:
        with self.client() as c:
            return docker_images.pull(c, image)

    def tag_image(self, image_id: str, tag: str) -> None:
        with self.client() as c:
            docker_images.tag_image(c, image_id, tag, engine=self.name)

    def remove_image(self, ref: str) -> None:
        with self.client() as c:
            docker_images.remove_image(c, ref)

    def smoke_run(self, image: str, argv: tuple[str, ...]) -> tuple[int | None, str]:
        with self.client() as c:
            return docker_images.smoke_run(c, image, argv, engine=self.name)

    def find(self, *, job_id: str | None = None, root: str | None = None) -> list[Box]:
        with self.client() as c:
            found = find_containers(c, job_id=job_id, root=root)
        return [
            Box(
                id=str(x.id),
                name=str(x.name),
                status=str(x.status),
                labels=dict(x.labels or {}),
                exit_code=(x.attrs.get("State") or {}).get("ExitCode"),
            )
            for x in found
        ]

    def remove(self, box: Box) -> bool:
        with self.client() as c:
            try:
                c.api.remove_container(box.id, force=True, v=True)
                if box.labels.get(VOLUME_LABEL):  # the overlay strategy's work/ goes with it
                    _remove_volume(c, box.labels[VOLUME_LABEL])
            except NotFound:
                return False
            except APIError as e:
                if e.status_code == 409 and "already in progress" in str(e):
                    return True
                raise InfraError(f"{self.name} failed while removing container {box.name}: {e}") from e
            except _DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while removing container {box.name}: {e}") from e
        return True

    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        from . import egress as docker_egress

        with self.client() as c:
            try:
                return docker_egress.sweep(c, root, meta_dir, has_claim)
            except _DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping job networks: {e}") from e

    def sweep_volumes(self, root: str) -> list[tuple[str, str | None]]:
        """The daemon refuses to remove a volume a container uses (409), also an exited one's: a
        job's work volume goes only once its container is gone (a volume is made with its
        container, in the same request, so none is ever unused while its job needs it)."""
        gone: list[tuple[str, str | None]] = []
        with self.client() as c:
            try:
                found = c.api.volumes(filters={"label": [f"{LABEL}=1", f"{ROOT_LABEL}={root}"]})
                for v in (found or {}).get("Volumes") or []:
                    try:
                        c.api.remove_volume(v["Name"])
                    except NotFound:
                        continue
                    except APIError as e:
                        if e.status_code == 409:
                            continue  # in use
                        raise
                    gone.append((v["Name"], (v.get("Labels") or {}).get(JOB_LABEL)))
            except _DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping fila's volumes: {e}") from e
        return gone

    def runtimes(self) -> list[str]:
        with self.client() as c:
            try:
                return sorted((c.info().get("Runtimes") or {}).keys())
            except _DOCKER_ERRORS as e:
                raise InfraError(f"{self.name} failed while listing its runtimes: {e}") from e

    def runtime_for(self, policy: Policy) -> str | None:
        return docker_runtime(policy) if policy.runtime else None

    @contextlib.contextmanager
    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> Iterator[tuple[str, str]]:
        net_name = f"fila-{role}-{os.urandom(4).hex()}"
        labels = {LABEL: "1", "fila.role": role}
        with self.client() as c:
            api = c.api
            cid = None
            try:
                try:
                    net = c.networks.create(net_name, driver="bridge", internal=True, labels=labels)
                    host_config = api.create_host_config(
                        read_only=True,
                        cap_drop=["ALL"],
                        security_opt=["no-new-privileges:true"],
                        mem_limit=64 << 20,
                        pids_limit=32,
                        network_mode=net_name,
                    )
                    networking = api.create_networking_config(
                        {net_name: api.create_endpoint_config(aliases=aliases)}
                    )
                    cid = api.create_container(
                        image,
                        entrypoint=argv,
                        user="65534:65534",
                        labels=labels,
                        host_config=host_config,
                        networking_config=networking,
                    )["Id"]
                    api.start(cid)
                    net.reload()
                    subnet = str(net.attrs["IPAM"]["Config"][0]["Subnet"])
                except _DOCKER_ERRORS as e:
                    raise InfraError(f"{self.name} failed while starting the {role} upstream: {e}") from e
                yield net_name, subnet
            finally:
                if cid is not None:
                    with contextlib.suppress(*_DOCKER_ERRORS):
                        api.remove_container(cid, force=True)
                with contextlib.suppress(*_DOCKER_ERRORS):
                    api.remove_network(net_name)

    def refusal(self, err: BaseException) -> str | None:
        """Docker's own words when it refused a request as malformed (HTTP 400: an invalid image
        reference, a parameter or a limit out of range): the task's fault, not an outage."""
        cause = err.__cause__
        if isinstance(cause, APIError) and cause.status_code == 400:
            return str(cause.explanation or cause)
        return None

    def describe(self) -> dict[str, Any]:
        with self.client() as c:
            try:
                v = c.version()
            except _DOCKER_ERRORS as e:
                raise EngineUnavailable(f"the {self.name} engine does not answer: {e}") from e
        return {"name": self.name, "version": v.get("Version", "?"), "api": v.get("ApiVersion", "?")}
