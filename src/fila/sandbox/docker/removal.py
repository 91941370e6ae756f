"""Removing containers: by name, a removal already in progress left to finish, and, where two
share a network, one at a time (docs/security.md, "Spare gateways"); a gateway's departure held
to one at a time on its daemon.

One at a time because Docker 20.10's network code can deadlock the whole daemon when two
containers leave one user-defined network at once: the goroutine that deletes one's endpoint
(libnetwork's watch loop, holding the controller's lock) and the one that takes the other out of
its sandbox (holding the network's lock, then asking for the controller's) wait for each other,
and every later container operation waits behind them until the daemon is restarted. A job's
gateway and the holder of its engine's namespace are on one job network, so the holder goes only
once the gateway is gone; the gateway's removal itself waits out the daemon's clean-up after
its exit (the container's lock), so a gateway killed a moment before is no second leaver.

Every gateway on a host is also on the shared egress network (fila-egress), whoever's job it
serves: two jobs' gateways stopped at the same moment would leave it together. So a gateway that
may still run is killed, or removed, under the daemon's departure lock (`departure`), held from
the request until the daemon answers (the answer comes once the gateway's endpoints are
released). A gateway dead already (halted, exited) leaves nothing: its removal takes no lock.

Where the lock is (`departure_locks`): a file beside the daemon's socket, by the socket's real
path (`/run/docker.sock.fila-departures.lock`), when that directory is root's or this user's and
nobody else may write in it, so only who may already command the daemon can make, replace or
hold it; the socket's group may read and write it when that group may use the socket, so every
fila process speaking to the daemon, whatever its queue root or user, takes the same one. A user
who may not make or open it there (a docker-group user before any root fila made it) takes one
of its own in a directory of its own (OWN_DIR, 0700): its own processes, reapers included,
exclude each other, not other users' (another user who makes that directory first turns it off).

How it is waited for: tried every DEPARTURE_POLL_S, and a departure leaves it free
DEPARTURE_GAP_S, several tries long, before its process may take it again, so back-to-back
departures (a sweep) starve no one and no thread is left blocked on it. Not free within
DEPARTURE_WAIT_S, the departure goes without (a job held up for good would be worse than the
race), and that process then waits only DEPARTURE_RECHECK_WAIT_S a departure for
DEPARTURE_RECHECK_S (a stopped process keeping it costs a sweep one wait, not one a gateway).

It is a precaution, not a guarantee: a gateway that dies by itself leaves unannounced; a
one-shot process that exits before its kill's answer lets go of the lock with it; a daemon
reached over TCP, or a socket seen under another path (fila in a container with the socket
mounted; a hard link), goes without or with another lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import docker
from docker.errors import APIError, NotFound

from ...core.errors import InfraError
from ...core.fsutil import file_lock
from ...egress.config import ROLE_GATEWAY, ROLE_LABEL
from .client import DOCKER_ERRORS, socket_path

# How often a removal another client started is looked at until the container is gone.
GONE_POLL_S = 0.02
# How long a removal another client started, or a network's last endpoint, is waited for.
SETTLE_S = 60.0
# How long a gateway's departure waits for the daemon's departure lock before it goes without: a
# departure holds it 0.1-0.25 s, so this is twenty or more jobs ending at once.
DEPARTURE_WAIT_S = 5.0
# How often a waiting departure tries the lock, and how long one leaves it free after letting go
# of it before its process may take it again (a sweep's next gateway): several tries long, so a
# waiter, even on a busy machine, finds it free.
DEPARTURE_POLL_S = 0.002
DEPARTURE_GAP_S = 0.01
# A container in these states may still be on its networks (one exited, dead or never started
# has none to leave).
ON_NETWORKS = frozenset({"running", "paused", "restarting", "removing"})
SUFFIX = ".fila-departures.lock"
# This user's own departure locks, when it may not make or open the daemon's.
OWN_DIR = "/tmp/fila-departures-{uid}"
# After a lock was not free for a whole DEPARTURE_WAIT_S, how long this process waits for it only
# DEPARTURE_RECHECK_WAIT_S a departure (a few departures' holds).
DEPARTURE_RECHECK_S = 30.0
DEPARTURE_RECHECK_WAIT_S = 0.5
_unfree_until: dict[Path, float] = {}


def departure_locks(client: docker.DockerClient) -> list[Path]:
    """Where `client`'s daemon's departure lock may be, in order: beside its Unix socket, by the
    socket's real path (`/var/run/docker.sock` and `/run/docker.sock` are one daemon, one lock),
    when only root or this user may write there; this user's own (OWN_DIR, whatever the
    environment: a reaper has none). None for a daemon reached otherwise (TCP, TLS, SSH)."""
    sock = socket_path(client)
    if sock is None:
        return []
    real = os.path.realpath(sock)
    found = []
    if _only_trusted_write(Path(real).parent):
        found.append(Path(real + SUFFIX))
    digest = hashlib.sha256(real.encode()).hexdigest()[:16]
    found.append(Path(OWN_DIR.format(uid=os.getuid())) / f"{digest}.lock")
    return found


def _own_dir(directory: Path) -> None:
    """Make `directory` (OWN_DIR) this user's, mode 0700, unless it is already; PermissionError
    when what is there is not (another user made it first, or a link): no lock of its own then."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    st = os.lstat(directory)
    if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077):
        raise PermissionError(f"{directory} is not a directory of this user's alone")


def _only_trusted_write(directory: Path) -> bool:
    """Whether `directory` is root's or this user's and nobody else may write in it (no group or
    other write bit): who could plant or replace a lock there."""
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return st.st_uid in (0, os.getuid()) and not st.st_mode & 0o022


def departs(labels: dict[str, str], state: str | None) -> bool:
    """Whether removing the container with these labels and state (`running`, `exited`, ...;
    None when unknown) is a gateway's departure from its networks."""
    return labels.get(ROLE_LABEL) == ROLE_GATEWAY and (state is None or state in ON_NETWORKS)


@contextlib.contextmanager
def departure(client: docker.DockerClient) -> Iterator[bool]:
    """Held while one of fila's gateways leaves its networks on `client`'s daemon (its kill, or
    its removal while it may run, until the daemon answers). Yields whether the lock is held:
    False when there is none this user can take or it is not free within DEPARTURE_WAIT_S (the
    departure goes ahead all the same; the module's docstring says why)."""
    with contextlib.ExitStack() as stack:
        held = False
        for path in departure_locks(client):
            # Not free for a whole wait a moment ago (a stopped process keeps it): waited for
            # briefly (a few holds of a sweep in progress), so a sweep of many gateways does not
            # wait that long for each.
            recheck = time.monotonic() < _unfree_until.get(path, 0.0)
            wait_s = DEPARTURE_RECHECK_WAIT_S if recheck else DEPARTURE_WAIT_S
            try:
                _make_lock_file(path)
                lock = file_lock(path, create=False, wait_s=wait_s, poll_s=DEPARTURE_POLL_S)
                held = stack.enter_context(lock)
                _unfree_until.pop(path, None)
                break
            except TimeoutError:  # held by another all along: no second lock would be the same
                if not recheck:
                    _unfree_until[path] = time.monotonic() + DEPARTURE_RECHECK_S
                break
            except OSError:  # not this user's to make or open: the next place
                continue
        yield held
    if held:
        time.sleep(DEPARTURE_GAP_S)


def _make_lock_file(path: Path) -> None:
    """Make `path`, unless it exists, a lock file (mode 0600); beside a socket, one its group can
    open when the group may command the daemon (`_socket_group`): every user who may speak to it
    takes the same lock. One of this user's that lost that group or mode (made while the socket
    was being made again, or its group changed since) is given them back."""
    beside = path.name.endswith(SUFFIX)
    if not beside:
        _own_dir(path.parent)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not (beside and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()):
            return
        fd = os.open(path, flags | os.O_RDONLY | os.O_NONBLOCK)
    try:
        if beside:
            with contextlib.suppress(OSError):  # a group this user is not in: this user's alone
                gid, mode = _socket_group(path)
                st = os.fstat(fd)
                if (st.st_gid, stat.S_IMODE(st.st_mode)) != (gid, mode):
                    os.fchown(fd, -1, gid)
                    os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _socket_group(lock: Path) -> tuple[int, int]:
    """The group of the socket `lock` is beside, and the lock's mode: read and write for that
    group only when the socket grants the group both (who may command the daemon)."""
    st = os.stat(str(lock).removesuffix(SUFFIX))
    return st.st_gid, 0o600 | (0o060 if st.st_mode & 0o060 == 0o060 else 0)


def remove_container(client: docker.DockerClient, name: str, *, leaving: bool = False) -> bool:
    """Force-remove `name` with its anonymous volumes: False when it was gone already; a
    removal in progress (another client's) is not an error. `leaving`: `name` is a gateway that
    may still run (`departs`), whose removal holds the daemon's departure lock."""
    with departure(client) if leaving else contextlib.nullcontext():
        try:
            client.api.remove_container(name, force=True, v=True)
        except NotFound:
            return False
        except APIError as e:
            if e.status_code == 409 and "already in progress" in str(e):
                return True
            raise
    return True


def remove_in_turn(
    client: docker.DockerClient, names: list[str], deadline: float, *, leaving: bool = True
) -> list[str]:
    """Remove the containers `names` one after the other, each gone before the next one starts
    (a removal in progress waited out until `deadline`, a monotonic time); what could not be
    removed, described. One that is not gone stops the turn: the next would leave the network
    beside it, so they are left to `fila recover`, which removes them one by one. `names[0]` is
    a gateway (the callers': egress.stop, the one-shot's reaper); `leaving`: it may still run
    (not halted), and its removal holds the departure lock."""
    for i, name in enumerate(names):
        try:
            remove_container(client, name, leaving=leaving and i == 0)
            while True:
                try:
                    client.api.inspect_container(name)
                except NotFound:
                    break
                if time.monotonic() > deadline:
                    raise InfraError("its removal did not end in time")
                time.sleep(GONE_POLL_S)
        except (*DOCKER_ERRORS, InfraError) as e:
            return [f"container {name}: {e}"] + [
                f"container {n}: left, since {name} was not gone" for n in names[i + 1 :]
            ]
    return []
