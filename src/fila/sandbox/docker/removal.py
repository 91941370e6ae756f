"""Removing containers: by name, a removal already in progress left to finish, and, where two
share a network, one at a time (docs/security.md, "Spare gateways"); a gateway's departure held
to one at a time on the host.

One at a time because Docker 20.10's network code can deadlock the whole daemon when two
containers leave one user-defined network at once: the goroutine that deletes one's endpoint
(libnetwork's watch loop, holding the controller's lock) and the one that takes the other out of
its sandbox (holding the network's lock, then asking for the controller's) wait for each other,
and every later container operation waits behind them until the daemon is restarted. A job's
gateway and the holder of its engine's namespace are on one job network, so the holder goes only
once the gateway is gone; the gateway's removal itself waits out the daemon's clean-up after
its exit (the container's lock), so a gateway killed a moment before is no second leaver.

Every gateway on a host is also on the shared egress network (fila-egress), whoever's job it
serves: two jobs' gateways stopped at the same moment would leave it together. So a gateway's
kill, and its removal, hold the host's departure lock (`departure`): a file lock of every fila
process speaking to that daemon, whatever its queue root or user, from the request until the
daemon answers it (the answer comes once the gateway's endpoints are released). It is a
precaution, not a guarantee: a gateway that dies by itself leaves unannounced, a one-shot
process that exits before its kill's answer lets go of the lock with it, and a lock that
cannot be opened or is not free within DEPARTURE_WAIT_S (another user's file; a process that
keeps it) is gone without, since a job held up for good would be worse than the race.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import docker
from docker.errors import APIError, NotFound

from ...core.errors import InfraError
from ...core.fsutil import file_lock
from .client import DOCKER_ERRORS, socket_path

# How often a removal another client started is looked at until the container is gone.
GONE_POLL_S = 0.02
# How long a removal another client started, or a network's last endpoint, is waited for.
SETTLE_S = 60.0
# How long a gateway's departure waits for the host's departure lock before it goes without: a
# departure holds it a tenth of a second or so, so this is dozens of jobs ending at once.
DEPARTURE_WAIT_S = 5.0
# How often a departure tries the lock again.
DEPARTURE_POLL_S = 0.005
# Where departure locks are: one directory for every user, whatever TMPDIR says.
LOCK_DIR = Path("/tmp")


def departure_lock(client: docker.DockerClient) -> Path:
    """The departure lock of `client`'s daemon: one file per daemon address, so every fila
    process speaking to that daemon finds the same one."""
    where = socket_path(client) or str(client.api.base_url)
    return LOCK_DIR / f"fila-departures-{hashlib.sha256(where.encode()).hexdigest()[:16]}.lock"


@contextlib.contextmanager
def departure(client: docker.DockerClient) -> Iterator[bool]:
    """Held while one of fila's gateways leaves its networks on `client`'s daemon (its kill,
    or its removal while it may run, until the daemon answers). Yields whether the lock is held:
    False when it cannot be opened or is not free within DEPARTURE_WAIT_S (the departure goes
    ahead all the same; the module's docstring says why)."""
    path = departure_lock(client)
    with contextlib.ExitStack() as stack:
        try:
            _shared_lock_file(path)
            stack.enter_context(
                file_lock(path, create=False, wait_s=DEPARTURE_WAIT_S, poll_s=DEPARTURE_POLL_S)
            )
            held = True
        except OSError:  # TimeoutError included
            held = False
        yield held


def _shared_lock_file(path: Path) -> None:
    """Make `path` a lock file any user can open to lock, unless it exists (whoever made it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o666)  # the umask's bits back: another user's fila locks it too
    finally:
        os.close(fd)


def remove_container(client: docker.DockerClient, name: str, *, departs: bool = False) -> bool:
    """Force-remove `name` with its anonymous volumes: False when it was gone already; a
    removal in progress (another client's) is not an error. `departs`: `name` is a gateway,
    perhaps running, whose removal holds the host's departure lock."""
    with departure(client) if departs else contextlib.nullcontext():
        try:
            client.api.remove_container(name, force=True, v=True)
        except NotFound:
            return False
        except APIError as e:
            if e.status_code == 409 and "already in progress" in str(e):
                return True
            raise
    return True


def remove_in_turn(client: docker.DockerClient, names: list[str], deadline: float) -> list[str]:
    """Remove the containers `names` one after the other, each gone before the next one starts
    (a removal in progress waited out until `deadline`, a monotonic time); what could not be
    removed, described. One that is not gone stops the turn: the next would leave the network
    beside it, so they are left to `fila recover`, which removes them one by one. `names[0]` is
    a gateway (the callers': egress.stop, the one-shot's reaper): its removal departs."""
    for i, name in enumerate(names):
        try:
            remove_container(client, name, departs=i == 0)
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
