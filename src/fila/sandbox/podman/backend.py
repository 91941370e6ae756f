"""The Podman backend: rootless Podman through its API socket, no root daemon, no docker group.

Podman speaks the Docker API, so most calls are DockerBackend's (the Docker SDK against the user's
Podman socket). What differs is here:
- The container is created through Podman's own endpoint (`/libpod/containers/create`): the
  Docker-compatible one ignores ulimits in rootless mode (podman#25881, fixed in 5.5; Debian 12 has
  4.3) and cannot ask for `userns=keep-id`, which rootless Podman needs so that the engine runs with
  the user's own uid and can write work/. `libpod_spec` maps create_kwargs' request to it: a pure
  function that refuses any key it does not know, so a new hardening flag cannot be dropped here
  in silence.
- What the host can enforce is measured (`podman info`): rootless containers on cgroup v1 get no
  memory, cpu or pids limits ("Resource limits are not supported and ignored on cgroups V1 rootless
  systems"), so a policy is refused before any container starts unless it `waive`s them.
- `network: allowlist`: the job network and the gateway are made with Podman's own API
  (podman_egress: an internal network with DNS off, the gateway on it and on the egress network).
- The socket is found ($CONTAINER_HOST, $XDG_RUNTIME_DIR/podman/podman.sock, or where `podman info`
  says), or fila starts `podman system service` for its own use (and says so on stderr).
- The runtime directory is the user's alone, as Podman itself demands: fila uses no directory
  there (nor the socket, pause.pid, its config or log) that another uid owns or may write into;
  /tmp/podman-run-$UID could be made first by anyone (check_runtime).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container

from ...core.errors import EngineUnavailable, InfraError, InvalidInput, InvalidPolicy
from ...core.fsutil import atomic_write
from ...core.models import Policy
from ...core.untrusted import read_capped
from ..base import JOB_LABEL, ROOT_LABEL, WAIVABLE, Box, RunResult, RunSpec, note_left
from ..docker import backend as dk
from ..docker import images as docker_images

SERVICE_IDLE_S = 600  # a service fila started exits after this long without a client
START_WAIT_S = 20.0
_ERRORS = (DockerException, requests.RequestException, OSError)


def default_socket() -> Path:
    """Where rootless Podman puts its API socket for this user (podman's own rule)."""
    if os.getuid() == 0:
        return Path("/run/podman/podman.sock")
    run_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/podman-run-{os.getuid()}"
    return Path(run_dir) / "podman" / "podman.sock"


def socket_from_env() -> Path | None:
    host = os.environ.get("CONTAINER_HOST", "")
    if host.startswith("unix://"):
        return Path(host.removeprefix("unix://"))
    return None


# -- the runtime directory: this user's alone ---------------------------------------------------


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def not_own(st: os.stat_result, *, kind: str) -> str | None:
    """Why an entry (lstat'ed) is not this user's alone, or None: `kind` "dir" is a directory
    (not a symlink) of this uid that group and others may not write into (Podman's own rule for
    its runtime directory); "socket" and "file" are a socket or regular file of this uid."""
    want = {"dir": stat.S_ISDIR, "socket": stat.S_ISSOCK, "file": stat.S_ISREG}[kind]
    uid = os.getuid()
    if not want(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else f"not a {'directory' if kind == 'dir' else kind}"
        return f"is {what} (owner {_owner(st.st_uid)})"
    if st.st_uid != uid:
        mode = stat.S_IMODE(st.st_mode)
        return f"is owned by {_owner(st.st_uid)}, mode {mode:04o}, not by this user (uid {uid})"
    if kind == "dir" and st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def runtime_dirs(socket: Path) -> list[Path]:
    """The directories of `socket` that must be this user's: the socket's own, and the runtime
    directory above it where the socket is Podman's default one (pause.pid is kept there too)."""
    if socket == default_socket():
        return [socket.parent.parent, socket.parent]
    return [socket.parent]


def check_runtime(socket: Path, *, create: bool = False) -> None:
    """Refuse (EngineUnavailable, naming the entry, its owner and mode) a runtime directory or a
    socket of Podman's that is not this user's alone: whoever owns it, or may write into it, could
    answer as Podman (and read every job's spec), or swap the files fila writes there for links.
    With `create`, a missing directory is made (0700) and then checked like any other; an existing
    one is never taken over. A missing socket is fine (fila may start the service)."""
    for d in runtime_dirs(socket):
        if create:
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise EngineUnavailable(
                    f"cannot create Podman's runtime directory: {e.strerror}",
                    path=d,
                    hint="set XDG_RUNTIME_DIR to a directory of your own (mode 0700), or start Podman's "
                    "socket yourself and name it in CONTAINER_HOST",
                ) from None
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return  # nothing there yet: nothing to connect to, nothing read
        why = not_own(st, kind="dir")
        if why:
            raise EngineUnavailable(
                f"Podman's runtime directory {why}; fila does not use it (another user could answer as "
                "Podman there, or swap what fila writes for links)",
                path=d,
                hint="remove it (as its owner or root) if it is not yours and run again, or set "
                "XDG_RUNTIME_DIR to a directory of your own (mode 0700); `chmod go-w` it if it is yours",
            )
    try:
        st = os.lstat(socket)
    except FileNotFoundError:
        return
    why = not_own(st, kind="socket")
    if why:
        raise EngineUnavailable(
            f"the Podman API socket {why}; fila does not connect to it",
            path=socket,
            hint="remove it (as its owner or root) and run again: fila starts its own service; or name "
            "your own socket in CONTAINER_HOST",
        )


def job_scratch(labels: dict[str, str]) -> Path | None:
    """The overlay scratch directory a container's labels name (`<root>/sandbox/meta/<job>/overlay/
    work`), checked against fila's own job layout before anything in it is removed: the root an
    absolute path without a symlink in it, the job a job id, and every directory from the root
    down to the scratch a real directory of this user's. None when it is not there. A label is
    whatever the engine answers: one that does not pass raises ValueError naming why."""
    from ...core.layout import Root
    from ...core.states import valid_id
    from ...workspace.snapshot import overlay_dir

    root, job = labels.get(ROOT_LABEL, ""), labels.get(JOB_LABEL, "")
    if not os.path.isabs(root) or os.path.realpath(root) != root:
        raise ValueError(f"its root label {root!r} is not an absolute path free of symlinks")
    if not valid_id(job):
        raise ValueError(f"its job label {job!r} is not a job id")
    scratch = overlay_dir(Root(Path(root)), job) / "work"
    here = Path(root)
    for part in ("", *scratch.relative_to(root).parts):
        here = here / part if part else here
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"{here} {not_own(st, kind='dir')}")
    return scratch


# -- the request -----------------------------------------------------------------------------------

_SIGNALS = {"SIGTERM": 15, "SIGKILL": 9, "SIGINT": 2}
_LIMIT_KEYS = {"mem_limit": "memory", "memswap_limit": "memory", "nano_cpus": "cpus", "pids_limit": "pids"}


# The overlay options create_kwargs' work/ volume carries, and what Podman's own overlay volume
# (`-v LOWER:DST:O,upperdir=U,workdir=W`) makes of them: Podman adds `userxattr` itself when it
# mounts rootless (seen in the container's mountinfo: `redirect_dir=nofollow,uuid=on,userxattr`).
_OVERLAY_OPTS = ("lowerdir", "upperdir", "workdir")


def _overlay_volume(m: Any) -> dict[str, Any]:
    """The overlay strategy's work/ (a Docker `local` volume of type overlay) as libpod's
    `overlay_volumes` entry: the snapshot is its lower layer, the job's upper and scratch
    directories are given, so the host reads the upper layer after the container is gone."""
    vo = m.get("VolumeOptions") or {}
    dc = vo.get("DriverConfig") or {}
    opts = dict(dc.get("Options") or {})
    kind = (dc.get("Name"), opts.pop("type", None), opts.pop("device", None))
    if kind != ("local", "overlay", "overlay"):
        raise ValueError(f"libpod_spec: volume {m.get('Source')!r} is not an overlay of the local driver")
    given = str(opts.pop("o", ""))
    if opts:
        raise ValueError(f"libpod_spec: overlay volume options {sorted(opts)} are not mapped")
    fields: dict[str, str] = {}
    for o in given.split(","):
        k, _, v = o.partition("=")
        if k == "userxattr" and not v:
            continue
        if k not in _OVERLAY_OPTS or not v or k in fields:
            raise ValueError(f"libpod_spec: overlay mount option {o!r} is not mapped")
        fields[k] = v
    if sorted(fields) != sorted(_OVERLAY_OPTS) or m.get("ReadOnly"):
        raise ValueError("libpod_spec: an overlay work/ needs lowerdir, upperdir and workdir, read-write")
    return {
        "destination": m["Target"],
        "source": fields["lowerdir"],
        "options": [f"upperdir={fields['upperdir']}", f"workdir={fields['workdir']}"],
    }


def _mount(m: Any) -> dict[str, Any]:
    if m.get("Type") != "bind":
        raise ValueError(f"libpod_spec: mount type {m.get('Type')!r} is not mapped")
    return {
        "destination": m["Target"],
        "source": m["Source"],
        "type": "bind",
        "options": ["rbind", "ro" if m.get("ReadOnly") else "rw"],
    }


def _tmpfs(target: str, opts: str) -> dict[str, Any]:
    out = []
    for o in opts.split(","):
        # Podman has no uid=/gid= for a tmpfs: "U" makes it the container user's (keep-id: the
        # user fila runs as, the uid create_kwargs asked for).
        if o.startswith(("uid=", "gid=")):
            if "U" not in out:
                out.append("U")
            continue
        out.append(o)
    return {"destination": target, "type": "tmpfs", "source": "tmpfs", "options": out}


def libpod_spec(
    kwargs: dict[str, Any], *, rootless: bool, waive: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """create_kwargs' request as Podman's SpecGenerator. Limits named in `waive` are left out (the
    policy waived them and the host cannot enforce them); every other key must be mapped."""
    kw = dict(kwargs)
    spec: dict[str, Any] = {
        "image": kw.pop("image"),
        "name": kw.pop("name"),
        "entrypoint": list(kw.pop("entrypoint")),
        "command": list(kw.pop("command")),
        "env": dict(kw.pop("environment")),
        "work_dir": kw.pop("working_dir"),
        "user": kw.pop("user"),
        "hostname": kw.pop("hostname"),
        "labels": dict(kw.pop("labels")),
        "read_only_filesystem": bool(kw.pop("read_only")),
        "cap_drop": list(kw.pop("cap_drop")),
        "privileged": bool(kw.pop("privileged")),
        "init": bool(kw.pop("init")),
        "oom_score_adj": int(kw.pop("oom_score_adj")),
        "stop_signal": _SIGNALS[kw.pop("stop_signal")],
        "terminal": bool(kw.pop("tty")),
        "stdin": bool(kw.pop("stdin_open")),
        "r_limits": [{"type": u["Name"], "soft": u["Soft"], "hard": u["Hard"]} for u in kw.pop("ulimits")],
        "userns": {"nsmode": "keep-id"} if rootless else {"nsmode": "host"},
    }
    if kw.pop("ipc_mode") != "private":
        raise ValueError("libpod_spec: only a private IPC namespace is mapped")
    spec["ipcns"] = {"nsmode": "private"}
    sec = kw.pop("security_opt")
    if sec != ["no-new-privileges:true"]:
        raise ValueError(f"libpod_spec: security_opt {sec!r} is not mapped")
    spec["no_new_privileges"] = True
    all_mounts = kw.pop("mounts")
    mounts = [_mount(m) for m in all_mounts if m.get("Type") != "volume"]
    mounts += [_tmpfs(t, o) for t, o in kw.pop("tmpfs").items()]
    spec["mounts"] = mounts
    overlays = [_overlay_volume(m) for m in all_mounts if m.get("Type") == "volume"]
    if overlays:
        spec["overlay_volumes"] = overlays
    net = kw.pop("network_mode")
    if net == "none":
        spec["netns"] = {"nsmode": "none"}
    elif net == "bridge":
        spec["netns"] = {"nsmode": "slirp4netns" if rootless else "bridge"}
    elif net.startswith("fila-net-"):
        # network allowlist (podman_egress): the job network only, the gateway its only
        # resolver, and no IPv6 in the engine's namespace (no link-local path to the bridge).
        spec["netns"] = {"nsmode": "bridge"}
        spec["Networks"] = {net: {}}  # Podman 4.3's SpecGenerator spells this one with a capital N
        spec["dns_server"] = list(kw.pop("dns"))
        spec["sysctl"] = {"net.ipv6.conf.all.disable_ipv6": "1"}
    else:
        raise ValueError(f"libpod_spec: network {net!r} is not mapped")
    log = kw.pop("log_config")
    spec["log_configuration"] = {"driver": "k8s-file", "size": int(log["Config"]["max-size"])}
    limits: dict[str, Any] = {}
    mem, swap = kw.pop("mem_limit"), kw.pop("memswap_limit")
    cpus, pids = kw.pop("nano_cpus"), kw.pop("pids_limit")
    if "memory" not in waive:
        limits["memory"] = {"limit": mem, "swap": swap}
    if "cpus" not in waive:
        limits["cpu"] = {"quota": max(1000, cpus * 100_000 // 1_000_000_000), "period": 100_000}
    if "pids" not in waive:
        limits["pids"] = {"limit": pids}
    if limits:
        spec["resource_limits"] = limits
    if "runtime" in kw:
        spec["oci_runtime"] = kw.pop("runtime")
    if kw:
        raise ValueError(f"libpod_spec: create_kwargs keys not mapped to Podman: {sorted(kw)}")
    return spec


# -- the overlay strategy -------------------------------------------------------------------------

# Measured on Podman 4.3 (Debian 12), kernel 6.18, rootless without a mount program: the upper
# layer takes deletions as character devices 0/0 and opaque directories as user.overlay.opaque,
# as snapshot.Layers reads them; an older Podman was not measured.
MIN_OVERLAY_VERSION = (4, 3)


def overlay_why(info: dict[str, Any], release: str, filesystems: str) -> str | None:
    """Why this Podman cannot give a job's work/ as an overlay of its snapshot (None: it can),
    from `podman info`, the kernel release and /proc/filesystems. Rootless, Podman mounts an
    overlay volume with the kernel's overlay in the user namespace (5.11+), or with the storage's
    mount program (fuse-overlayfs) when one is configured: fila has not seen what that one writes
    for a deletion here, so its upper layer is not read, and the job copies its targets."""
    if "\toverlay\n" not in filesystems:
        return "this kernel has no overlay filesystem"
    raw = str((info.get("version") or {}).get("Version") or "")
    found = re.match(r"(\d+)\.(\d+)", raw)
    if found is None or (int(found[1]), int(found[2])) < MIN_OVERLAY_VERSION:
        want = ".".join(map(str, MIN_OVERLAY_VERSION))
        return f"podman {raw or '?'} is older than {want}, the version whose overlay volumes were measured"
    if not ((info.get("host") or {}).get("security") or {}).get("rootless"):
        # Root's Podman marks opaque directories with trusted.* xattrs and runs the engine without
        # keep-id: a different upper layer and ownership, not measured here.
        return "podman runs as root here: only rootless Podman's overlay volumes were measured"
    kernel = re.match(r"(\d+)\.(\d+)", release)
    if kernel is None or (int(kernel[1]), int(kernel[2])) < (5, 11):
        return (
            f"rootless podman on kernel {release} mounts overlay volumes with fuse-overlayfs (the "
            "kernel's overlay in a user namespace needs 5.11+), whose upper layer fila does not read"
        )
    graph = (info.get("store") or {}).get("graphOptions") or {}
    program = next((v for k, v in graph.items() if k.endswith("mount_program")), None)
    if program:
        exe = program.get("Executable") if isinstance(program, dict) else program
        return (
            f"podman's storage names a mount program ({exe}), which would mount the overlay: fila "
            "reads only the kernel overlay's upper layer (whiteouts as devices 0/0)"
        )
    return None


# -- the client ----------------------------------------------------------------------------------

# How often Podman checks a container's state while a wait request is open (libpod's `interval`).
WAIT_INTERVAL = "10ms"


class PodmanAPI(docker.APIClient):
    """The Docker SDK's API client, with a container's wait on Podman's own endpoint. Podman 4.3's
    Docker-compatible wait looks at the container every 250 ms and answered a no-op container's
    exit 0.34 s later than its libpod wait at 10 ms (start to exit, medians of 11 each, alternated,
    0.63 s against 0.28 s): once per job, as long again as the `podman run` CLI takes in all."""

    def wait(
        self, container: Any, timeout: float | None = None, condition: str | None = None
    ) -> dict[str, Any]:
        if condition not in (None, "not-running"):  # next-exit, removed: Docker's own meaning
            return dict(super().wait(container, timeout=timeout, condition=condition))
        cid = container.get("Id") if isinstance(container, dict) else container
        # Stopped (its process gone) or exited (also cleaned up): Docker's not-running.
        res = self._post(self._url("/libpod/containers/{0}/wait", cid), timeout=timeout,
                         params={"condition": ["stopped", "exited"], "interval": WAIT_INTERVAL})  # fmt: skip
        return {"StatusCode": int(self._result(res, True)), "Error": None}


class PodmanClient(docker.DockerClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.api = PodmanAPI(*args, **kwargs)


# -- the service -----------------------------------------------------------------------------------


def _service_conf(path: Path) -> Path:
    """The containers.conf of a service fila starts: cgroupfs (no systemd user session is needed),
    events to a file, and runc where crun cannot run (cgroup v1 with a v2 hierarchy mounted beside:
    crun refuses "cgroups in hybrid mode")."""
    lines = ["[engine]", 'cgroup_manager = "cgroupfs"', 'events_logger = "file"']
    if Path("/sys/fs/cgroup/unified").is_dir() and shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin"):
        lines.append('runtime = "runc"')
    # Replaced by rename, never written through: a link planted at its name is not followed.
    atomic_write(path, "\n".join(lines) + "\n", mode=0o600)
    return path


def _podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        raise EngineUnavailable(
            "podman is not installed",
            hint="install it (Debian: apt-get install podman uidmap slirp4netns fuse-overlayfs), "
            "or choose another backend (FILA_BACKEND=docker)",
        )
    return exe


class PodmanBackend(dk.DockerBackend):
    name = "podman"
    allowlist = True  # the job network and gateway: podman_egress

    def __init__(
        self,
        socket: Path | None = None,
        *,
        autostart: bool = True,
        say: Callable[[str], None] | None = None,
        timeout: float = 60,
    ) -> None:
        super().__init__(None, timeout=timeout)
        self.socket = socket or socket_from_env() or default_socket()
        self.autostart = autostart
        self.say = say or (lambda m: print(f"fila: {m}", file=sys.stderr, flush=True))
        self._start_lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._overlay_why: list[str | None] | None = None

    # -- connections ----------------------------------------------------------------------------

    def _client(self, timeout: float) -> docker.DockerClient:
        c = PodmanClient(base_url=f"unix://{self.socket}", version="1.41", timeout=timeout)
        try:
            c.ping()
        except BaseException:
            c.close()
            raise
        return c

    def connect(self, timeout: float | None = None) -> docker.DockerClient:
        t = self._timeout if timeout is None else timeout
        check_runtime(self.socket)  # before anything is sent: the socket may be another user's
        try:
            return self._client(t)
        except _ERRORS as first:
            if not self.autostart:
                raise self._down(first) from first
            with self._start_lock:
                try:
                    return self._client(t)
                except _ERRORS:
                    pass
                self._start_service()
                try:
                    return self._client(t)
                except _ERRORS as e:
                    raise self._down(e) from e

    @contextlib.contextmanager
    def client(self) -> Iterator[docker.DockerClient]:
        """Docker's pooled client; an error's hint about the engine's health names Podman's own
        check and the socket fila used, not Docker's."""
        try:
            with super().client() as c:
                yield c
        except InfraError as e:
            if e.hint in docker_images.HEALTH_HINTS:
                e.hint = self.health_hint(retry=e.hint == docker_images.RUN_HINT)
            raise

    def health_hint(self, *, retry: bool = False) -> str:
        """What a person checks when Podman failed a call (as this user: rootless Podman is per user)."""
        hint = f"check `podman info` as this user (fila used the Podman API socket {self.socket})"
        return hint + ("; the task can be retried once Podman is healthy" if retry else "")

    def _down(self, err: BaseException) -> EngineUnavailable:
        return EngineUnavailable(
            f"the Podman API socket {self.socket} does not answer: {err}",
            hint="start it (`podman system service --time=0 &` or `systemctl --user start podman.socket`), "
            "or let fila start it (it does unless the socket was given); FILA_BACKEND=docker uses Docker",
        )

    def _start_service(self) -> None:
        exe = _podman()
        check_runtime(self.socket, create=True)  # this user's alone from here on: links only of its own
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a stale socket of a service that is gone
        env = dict(os.environ)
        env["CONTAINERS_CONF"] = str(_service_conf(self.socket.parent / "fila-containers.conf"))
        log = self.socket.parent / "fila-service.log"
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:  # ELOOP: a symlink at its name
            raise EngineUnavailable(
                f"cannot open the Podman service's log: {e.strerror} (a link there is not followed)",
                path=log,
                hint="remove it and run again",
            ) from None
        with open(fd, "ab") as out:
            proc = subprocess.Popen(
                [exe, "system", "service", f"--time={SERVICE_IDLE_S}", f"unix://{self.socket}"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,  # outlives this fila: the next command reuses it
            )
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineUnavailable(
                    f"`podman system service` exited with {proc.returncode}: "
                    f"{log.read_text(errors='replace')[-500:].strip()}",
                    hint="run `podman info` as this user to see what Podman needs",
                    path=log,
                )
            if self.socket.exists():
                with contextlib.suppress(*_ERRORS):
                    self._client(5).close()
                    self.say(
                        f"no Podman API socket answered; started `podman system service` (pid {proc.pid}) "
                        f"at {self.socket} for fila's use (it exits after {SERVICE_IDLE_S} s idle; log {log})"
                    )
                    return
            time.sleep(0.1)
        raise EngineUnavailable(f"`podman system service` did not answer within {START_WAIT_S:g} s", path=log)

    def ping(self) -> None:
        self.connect(timeout=15).close()

    # -- what the host enforces -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        if self._info is None:
            with self.client() as c:
                try:
                    self._info = dict(c.api._result(c.api._get(c.api._url("/libpod/info")), json=True))
                except _ERRORS as e:
                    raise InfraError(f"podman failed while describing its host: {e}") from e
        return self._info

    @property
    def rootless(self) -> bool:
        return bool(self.info().get("host", {}).get("security", {}).get("rootless"))

    def unenforceable(self, policy: Policy) -> list[str]:
        host = self.info().get("host", {})
        if not self.rootless:
            return []
        have = set(host.get("cgroupControllers") or [])
        need = {"memory": "memory", "pids": "pids", "cpus": "cpu"}
        return [w for w in WAIVABLE if need[w] not in have]

    def why_unenforceable(self) -> str:
        host = self.info().get("host", {})
        return (
            f"rootless Podman on cgroup {host.get('cgroupVersion', '?')} with controllers "
            f"{host.get('cgroupControllers') or 'none'} delegated: Podman ignores these limits there"
        )

    def check(self, policy: Policy, *, job_id: str | None = None) -> list[str]:
        if policy.network == "allowlist" and not self.allowlist:
            raise InvalidPolicy(
                "the podman backend does not run network allowlist (its job network and gateway are "
                "Docker's); the job was not started",
                hint="use network none (or bridge) with Podman, or FILA_BACKEND=docker for allowlist",
                task_id=job_id,
            )
        if policy.runtime and policy.runtime not in self.runtimes():
            raise InvalidPolicy(
                f"the policy's runtime {policy.runtime!r} is not one Podman has "
                f"({', '.join(self.runtimes())})",
                hint="install it and name it in containers.conf [engine.runtimes], or change the policy",
                task_id=job_id,
            )
        return super().check(policy, job_id=job_id)

    def runtime_for(self, policy: Policy) -> str | None:
        return policy.runtime

    def overlay_unsupported(self) -> str | None:
        """Measured once, from `podman info` and the kernel (overlay_why)."""
        if self._overlay_why is None:
            try:
                filesystems = Path("/proc/filesystems").read_text()
            except OSError:
                filesystems = ""
            try:
                info = self.info()
            except (InfraError, EngineUnavailable) as e:
                self._overlay_why = [f"podman did not say whether it can mount overlay volumes: {e}"]
            else:
                self._overlay_why = [overlay_why(info, os.uname().release, filesystems)]
        return self._overlay_why[0]

    @contextlib.contextmanager
    def _scratch_cleared(self, spec: RunSpec, rootless: bool) -> Iterator[None]:
        """After the run (the container and its mount gone), whatever way it ended; when the run
        failed, its error stays the one raised, and a scratch left behind is noted on it."""
        if spec.overlay is None or not rootless:
            yield
            return
        try:
            yield
        except BaseException as exc:
            try:
                self._clear_scratch(spec.overlay.scratch)
            except Exception as e:  # carried on the error (not only a note): the record says it
                note_left(exc, str(e), running=False)
            raise
        self._clear_scratch(spec.overlay.scratch)

    def clear_job_scratch(self, root: str, job_id: str) -> bool:
        """Empty a job's overlay scratch by its meta directory, not through a found container: a
        worker killed after its container's removal and before `_scratch_cleared` leaves it with
        no container, and the next attempt's job directory could not be made (the cycle calls
        this under the job's claim and lock, before it rebuilds the job directory)."""
        if not self.rootless:
            return False
        scratch = job_scratch({ROOT_LABEL: root, JOB_LABEL: job_id})
        if scratch is None:
            return False
        self._clear_scratch(scratch)
        return True

    def _pause_pid(self) -> int | None:
        """The pid of rootless Podman's pause process, which holds the user's namespace (Podman
        keeps it beside the API socket's directory: <run dir>/libpod/tmp/pause.pid); None when
        there is none of this user's."""
        run_dir = self.socket.parent.parent
        try:
            # Every directory on the way, and the file, this user's alone (check_runtime's rule):
            # the pid is the namespace whose root then runs `rm -rf`.
            for d in (run_dir, run_dir / "libpod", run_dir / "libpod" / "tmp"):
                if not_own(os.lstat(d), kind="dir"):
                    return None
            path = run_dir / "libpod" / "tmp" / "pause.pid"
            raw = read_capped(path, cap=64, kind="pause.pid", error=InvalidInput)  # no link followed
            if not_own(os.lstat(path), kind="file"):
                return None
            pid = int(raw.decode().strip())
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                return None
        except (OSError, ValueError, InvalidInput):
            return None
        return pid

    def _clear_scratch(self, scratch: Path) -> None:
        """Remove what the kernel left in the overlay's scratch directory (`workdir`): rootless,
        the mount is made by the container's root, a subordinate uid, so `work/` there is that
        uid's, mode 000, and holds the whiteout the upper layer's deletions are hard links of:
        the user could not remove it, nor gc or a requeue the job. rm runs as root of the user's
        own namespace (the user and their subordinate ids, as `podman unshare`), nothing more."""
        leftovers = [str(scratch / n) for n in ("work", "index") if (scratch / n).exists()]
        if not leftovers:
            return
        rm = ["rm", "-rf", "--one-file-system", "--", *leftovers]
        res = None
        pause = self._pause_pid()
        if pause is not None and shutil.which("nsenter"):
            # The same namespace `podman unshare` enters, joined directly: 2 ms, not Podman's 70.
            res = subprocess.run(["nsenter", "-U", "-t", str(pause), "--", *rm],
                                 capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        if res is None or res.returncode != 0 or any(Path(p).exists() for p in leftovers):
            res = subprocess.run([_podman(), "unshare", *rm], capture_output=True, text=True, timeout=60,
                                 check=False)  # fmt: skip
        if res.returncode != 0 or any(Path(p).exists() for p in leftovers):
            raise InfraError(
                f"the overlay's scratch directory could not be emptied: {res.stderr.strip()[-300:]}",
                path=scratch,
                hint=f"`podman unshare rm -rf {scratch}/work` as this user removes it",
            )

    def runtimes(self) -> list[str]:
        host = self.info().get("host", {})
        names = set((self.info().get("plugins") or {}).get("runtimes") or [])
        oci = (host.get("ociRuntime") or {}).get("name")
        return sorted(names | ({oci} if oci else set()))

    # -- the run --------------------------------------------------------------------------------

    def run(
        self,
        spec: RunSpec,
        *,
        before_start: Callable[[str], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> RunResult:
        waived = self.check(spec.policy, job_id=spec.job_id)
        rootless = self.rootless
        waive = frozenset(waived)

        def create(client: docker.DockerClient, kwargs: dict[str, Any]) -> Container:
            body = libpod_spec(kwargs, rootless=rootless, waive=waive)
            api = client.api
            try:
                res = api._result(api._post_json(api._url("/libpod/containers/create"), data=body), json=True)
            except NotFound as e:  # Podman: "<image>: image not known"
                raise ImageNotFound(str(e)) from e
            return client.containers.get(res["Id"])

        with self._scratch_cleared(spec, rootless), self.client() as c:
            if spec.policy.network == "allowlist":
                from . import egress as podman_egress

                result = podman_egress.run(
                    spec,
                    client=c,
                    create=create,
                    rootless=rootless,
                    waive=waive,
                    before_start=before_start,
                    heartbeat=heartbeat,
                    heartbeat_s=heartbeat_s,
                )
            else:
                result = dk.run(
                    spec,
                    client=c,
                    before_start=before_start,
                    heartbeat=heartbeat,
                    heartbeat_s=heartbeat_s,
                    create=create,
                )
        result.backend, result.waived = self.name, waived
        return result

    def remove(self, box: Box) -> bool:
        """Also the overlay scratch directory of the job's container (a crashed worker left it,
        and recovery removes the container): in the job's meta directory, named by its labels and
        checked against fila's job layout (job_scratch)."""
        gone = super().remove(box)
        if box.labels.get(dk.VOLUME_LABEL) and self.rootless:
            try:
                scratch = job_scratch(box.labels)
            except ValueError as e:
                self.say(f"the overlay scratch of container {box.name} was not removed: {e}")
                return gone
            if scratch is not None:
                self._clear_scratch(scratch)
        return gone

    def tags(self, image: str) -> list[str]:
        # Podman names local images with their registry (docker.io/fila/shell:latest, localhost/x).
        return sorted(
            {re.sub(r"^(?:docker\.io/(?:library/)?|localhost/)", "", t) for t in super().tags(image)}
        )

    def sweep_egress(
        self, root: Path, meta_dir: Path, has_claim: Callable[[str, str | None], bool]
    ) -> list[str]:
        from . import egress as podman_egress

        with self.client() as c:
            try:
                return podman_egress.sweep(c, root, meta_dir, has_claim)
            except _ERRORS as e:
                raise InfraError(f"{self.name} failed while sweeping job networks: {e}") from e

    def refusal(self, err: BaseException) -> str | None:
        cause = err.__cause__
        if isinstance(cause, APIError) and cause.status_code == 400:
            return str(cause.explanation or cause)
        return None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        host = self.info().get("host", {})
        return {
            **d,
            "name": self.name,
            "socket": str(self.socket),
            "rootless": self.rootless,
            "cgroup": host.get("cgroupVersion"),
            "controllers": host.get("cgroupControllers") or [],
        }

    def test_upstream(
        self, image: str, argv: list[str], aliases: list[str], *, role: str
    ) -> AbstractContextManager[tuple[str, str]]:
        raise InfraError(
            "the doctor's allowlist self-test has no Podman upstream yet (the allowlist itself runs on "
            "Podman: tests/test_podman_egress.py proves it); run `fila doctor` with FILA_BACKEND=docker"
        )


__all__ = ["PodmanBackend", "check_runtime", "default_socket", "job_scratch", "libpod_spec"]
