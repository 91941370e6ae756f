"""Removing containers: by name, a removal already in progress left to finish, and, where two
share a network, one at a time (docs/security.md, "Spare gateways").

One at a time because Docker 20.10's network code can deadlock the whole daemon when two
containers leave one user-defined network at once: the goroutine that deletes one's endpoint
(libnetwork's watch loop, holding the controller's lock) and the one that takes the other out of
its sandbox (holding the network's lock, then asking for the controller's) wait for each other,
and every later container operation waits behind them until the daemon is restarted. A job's
gateway and the holder of its engine's namespace are on one job network, so the holder goes only
once the gateway is gone; the gateway's removal itself waits out the daemon's clean-up after
its exit (the container's lock), so a gateway killed a moment before is no second leaver.
"""

from __future__ import annotations

import time

import docker
from docker.errors import APIError, NotFound

from ...core.errors import InfraError
from .client import DOCKER_ERRORS

# How often a removal another client started is looked at until the container is gone.
GONE_POLL_S = 0.02
# How long a removal another client started, or a network's last endpoint, is waited for.
SETTLE_S = 60.0


def remove_container(client: docker.DockerClient, name: str) -> None:
    """Force-remove `name` with its anonymous volumes; gone already, or a removal in progress
    (another client's), is not an error."""
    try:
        client.api.remove_container(name, force=True, v=True)
    except NotFound:
        pass
    except APIError as e:
        if e.status_code == 409 and "already in progress" in str(e):
            return
        raise


def remove_in_turn(client: docker.DockerClient, names: list[str], deadline: float) -> list[str]:
    """Remove the containers `names` one after the other, each gone before the next one starts
    (a removal in progress waited out until `deadline`, a monotonic time); what could not be
    removed, described. One that is not gone stops the turn: the next would leave the network
    beside it, so they are left to `fila recover`, which removes them one by one."""
    for i, name in enumerate(names):
        try:
            remove_container(client, name)
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
