"""sandbox/docker/removal.remove_in_turn: containers that share a network leave it one at a time
(docs/security.md, "Spare gateways"). The daemon here is a scripted one: a removal "already in
progress" (another client's) that ends when the script says is what a real daemon cannot be made
to show on demand; the real daemon's paths are in tests/test_egress.py (a gateway and its holder
removed by egress.stop and by the one-shot's reaper)."""

from __future__ import annotations

import time
from typing import Any

import docker
import requests

from fila.sandbox.docker.removal import remove_in_turn


class Daemon:
    """remove_container and inspect_container for named containers; `busy[name]` is how long
    another client's removal of it still runs (409 "already in progress" until then)."""

    def __init__(self, names: list[str], busy: dict[str, float]) -> None:
        self.alive = set(names)
        self.until = {n: time.monotonic() + s for n, s in busy.items()}
        self.calls: list[tuple[str, str, bool]] = []  # (call, name, was anything else still there)

    def remove_container(self, name: str, force: bool, v: bool) -> None:
        self.calls.append(("remove", name, bool(self.alive - {name})))
        if name in self.until:
            said = f"removal of container {name} is already in progress"
            raise docker.errors.APIError("Conflict", response=_response(409), explanation=said)
        self.alive.discard(name)

    def inspect_container(self, name: str) -> dict[str, Any]:
        if name in self.until and time.monotonic() >= self.until[name]:
            del self.until[name]
            self.alive.discard(name)
        if name not in self.alive:
            raise docker.errors.NotFound(f"no such container: {name}", response=_response(404))
        return {"Name": name}


def _response(code: int) -> requests.Response:
    r = requests.Response()
    r.status_code = code
    return r


class Client:
    def __init__(self, api: Daemon) -> None:
        self.api = api


def test_the_holder_goes_only_once_the_gateway_is_gone_and_is_left_when_it_is_not() -> None:
    # Allowed: the gateway's removal (another client's, in progress) ends within the deadline:
    # the holder is removed after it, with nothing else left.
    api = Daemon(["gw", "gw-netns"], busy={"gw": 0.2})
    assert remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 5) == []  # type: ignore[arg-type]
    assert [c[:2] for c in api.calls] == [("remove", "gw"), ("remove", "gw-netns")]
    assert api.calls[1][2] is False, "the holder was removed while the gateway was still there"
    assert api.alive == set()
    # Blocked: the gateway is still going at the deadline: the holder is not touched (it would
    # leave the network beside it), and both are said, for recovery.
    api = Daemon(["gw", "gw-netns"], busy={"gw": 5.0})
    errors = remove_in_turn(Client(api), ["gw", "gw-netns"], time.monotonic() + 0.2)  # type: ignore[arg-type]
    assert [c[:2] for c in api.calls] == [("remove", "gw")]
    assert len(errors) == 2 and "container gw:" in errors[0] and "did not end in time" in errors[0]
    assert errors[1] == "container gw-netns: left, since gw was not gone"
