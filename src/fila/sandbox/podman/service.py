"""Rootless Podman's API socket and service, this user's alone (docs/architecture.md, "Threat
model in brief").

- The socket is found ($CONTAINER_HOST, $XDG_RUNTIME_DIR/podman/podman.sock, or where `podman info`
  says), or fila starts `podman system service` for its own use (and says so on stderr).
- The runtime directory is the user's alone, as Podman itself demands: fila uses no directory
  there (nor the socket, pause.pid, its config or log) that another uid owns or may write into;
  /tmp/podman-run-$UID could be made first by anyone (check_runtime).
- The client is the Docker SDK's, with a container's wait on Podman's own endpoint (PodmanAPI).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import DockerException

from ...core.errors import EngineUnavailable
from ...core.fsutil import atomic_write

SERVICE_IDLE_S = 600  # a service fila started exits after this long without a client
START_WAIT_S = 20.0
ERRORS = (DockerException, requests.RequestException, OSError)


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


def service_conf(path: Path) -> Path:
    """The containers.conf of a service fila starts: cgroupfs (no systemd user session is needed),
    events to a file, and runc where crun cannot run (cgroup v1 with a v2 hierarchy mounted beside:
    crun refuses "cgroups in hybrid mode")."""
    lines = ["[engine]", 'cgroup_manager = "cgroupfs"', 'events_logger = "file"']
    if Path("/sys/fs/cgroup/unified").is_dir() and shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin"):
        lines.append('runtime = "runc"')
    # Replaced by rename, never written through: a link planted at its name is not followed.
    atomic_write(path, "\n".join(lines) + "\n", mode=0o600)
    return path


def podman_exe() -> str:
    exe = shutil.which("podman")
    if exe is None:
        raise EngineUnavailable(
            "podman is not installed",
            hint="install it (Debian: apt-get install podman uidmap slirp4netns fuse-overlayfs), "
            "or choose another backend (FILA_BACKEND=docker)",
        )
    return exe


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


def start_service(socket: Path, say: Callable[[str], None], answers: Callable[[], None]) -> None:
    """Start `podman system service` at `socket` for fila's own use (its containers.conf and log
    beside the socket, this user's alone), and wait until `answers()` (a checked client) returns."""
    exe = podman_exe()
    check_runtime(socket, create=True)  # this user's alone from here on: links only of its own
    with contextlib.suppress(FileNotFoundError):
        socket.unlink()  # a stale socket of a service that is gone
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = str(service_conf(socket.parent / "fila-containers.conf"))
    log = socket.parent / "fila-service.log"
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
            [exe, "system", "service", f"--time={SERVICE_IDLE_S}", f"unix://{socket}"],
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
        if socket.exists():
            with contextlib.suppress(*ERRORS):
                answers()
                say(
                    f"no Podman API socket answered; started `podman system service` (pid {proc.pid}) "
                    f"at {socket} for fila's use (it exits after {SERVICE_IDLE_S} s idle; log {log})"
                )
                return
        time.sleep(0.1)
    raise EngineUnavailable(f"`podman system service` did not answer within {START_WAIT_S:g} s", path=log)
