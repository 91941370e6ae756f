"""The job network's subnet, chosen by fila from a pool (docs/security.md, "The job network's
addresses"), so that the gateway's address is known before its container starts: the holder of
the engine's network namespace, whose resolver is that address, is then made and started beside
the gateway instead of after it (docs/benchmarks.md, "The one-shot path").

The pool is `FILA_JOB_SUBNETS` (comma-separated IPv4 CIDRs, default DEFAULT_POOL), cut into /29s:
the network's address, the bridge's (reserved by Docker even with no address on it), the
gateway (GATEWAY_HOST), the holder (HOLDER_HOST), an engine that joins the network itself (gVisor)
and the broadcast address. `FILA_JOB_SUBNETS=docker` leaves the choice to Docker (its default
pools): the gateway's address is then known only once it started, and the holder follows it.

Collisions: the daemon refuses a network whose subnet overlaps another of its networks (any
process's, any host sharing the daemon: one answer, under its lock), so a taken candidate costs
one refused create and the next is tried, with the daemon's networks listed once to skip the rest
in use; candidates that overlap a route of this host (its LAN, a VPN) are never tried.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError
from docker.models.networks import Network

from ...core.errors import InfraError

POOL_ENV = "FILA_JOB_SUBNETS"
DEFAULT_POOL = "10.231.0.0/16"
PREFIX = 29
GATEWAY_HOST = 2  # the gateway's address: the subnet's second host (the first is the bridge's)
HOLDER_HOST = 3
TRIES = 8  # refused creates before the pool is called full
ROUTES = Path("/proc/net/route")

Net = ipaddress.IPv4Network


@dataclass(frozen=True)
class JobSubnet:
    """A chosen subnet and the two fixed addresses in it."""

    subnet: Net

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + GATEWAY_HOST)

    @property
    def holder(self) -> str:
        return str(self.subnet.network_address + HOLDER_HOST)


def pool(value: str | None = None) -> list[Net] | None:
    """The configured pool (`value`, else FILA_JOB_SUBNETS, else DEFAULT_POOL), or None for
    `docker` (Docker chooses). InfraError names the variable for a value that is not a list of
    IPv4 networks of /29 or wider."""
    raw = (value if value is not None else os.environ.get(POOL_ENV, DEFAULT_POOL)).strip()
    if raw == "docker":
        return None
    nets: list[Net] = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        try:
            net = ipaddress.ip_network(item, strict=True)
        except ValueError as e:
            raise _bad(raw, str(e)) from None
        if not isinstance(net, Net) or net.prefixlen > PREFIX:
            raise _bad(raw, f"{item} is not an IPv4 network of /{PREFIX} or wider")
        nets.append(net)
    if not nets:
        raise _bad(raw, "no network given")
    return nets


def _bad(raw: str, why: str) -> InfraError:
    return InfraError(
        f"{POOL_ENV}={raw!r}: {why}",
        hint=f"give IPv4 CIDRs this host uses for nothing else (default {DEFAULT_POOL}), or `docker`",
    )


def host_routes(path: Path = ROUTES) -> list[Net]:
    """The destinations of this host's IPv4 routes, the default route left out (every subnet
    overlaps it); none when the table cannot be read."""
    out: list[Net] = []
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        with contextlib.suppress(ValueError, IndexError):
            dest, mask = (ipaddress.IPv4Address(int(x, 16).to_bytes(4, "little")) for x in (f[1], f[7]))
            net = Net(f"{dest}/{mask}", strict=False)
            if net.prefixlen:
                out.append(net)
    return out


def free(nets: list[Net], avoid: Iterable[Net]) -> list[Net]:
    """What of `nets` overlaps nothing in `avoid`, as networks of /PREFIX or wider."""
    left = list(nets)
    for a in avoid:
        nxt: list[Net] = []
        for n in left:
            if not n.overlaps(a):
                nxt.append(n)
            elif n.subnet_of(a):
                continue
            else:  # `a` inside `n`: the rest of `n` around it
                nxt.extend(n.address_exclude(a))
        left = nxt
    return [n for n in left if n.prefixlen <= PREFIX]


def pick(blocks: list[Net], rng: random.Random) -> Net:
    """A /PREFIX drawn evenly from `blocks` (concurrent jobs rarely draw the same one)."""
    sizes = [n.num_addresses >> (32 - PREFIX) for n in blocks]
    i = rng.randrange(sum(sizes))
    for net, size in zip(blocks, sizes, strict=True):
        if i < size:
            return Net((int(net.network_address) + (i << (32 - PREFIX)), PREFIX))
        i -= size
    raise AssertionError("unreachable: i < sum(sizes)")


def in_use(client: docker.DockerClient) -> list[Net]:
    """Every IPv4 subnet the daemon's networks hold."""
    out: list[Net] = []
    for n in client.api.networks():
        for c in (n.get("IPAM") or {}).get("Config") or []:
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(c.get("Subnet") or "", strict=False)
                if isinstance(net, Net):
                    out.append(net)
    return out


def create_network(
    client: docker.DockerClient,
    name: str,
    nets: list[Net],
    *,
    tries: int = TRIES,
    rng: random.Random | None = None,
    **kwargs: Any,
) -> tuple[Network, JobSubnet]:
    """`client.networks.create(name, **kwargs)` on a free /PREFIX of `nets`, tried until the
    daemon takes one: a subnet another network holds is refused (an overlap), and after the first
    refusal the daemon's networks are listed and skipped. InfraError when `tries` were refused or
    no /PREFIX is left; any other Docker error is raised as it is."""
    from docker.types import IPAMConfig, IPAMPool

    rng = rng or random.Random()
    avoid = host_routes()
    refused: list[Net] = []
    while len(refused) < tries:
        blocks = free(nets, [*avoid, *refused])
        if not blocks:
            break
        sub = pick(blocks, rng)
        ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=str(sub), gateway=str(sub.network_address + 1))])
        try:
            return client.networks.create(name, ipam=ipam, **kwargs), JobSubnet(sub)
        except APIError as e:
            if "overlap" not in str(e).lower():
                raise
        if not refused:  # taken: skip every subnet in use from now on
            avoid += in_use(client)
        refused.append(sub)
    spec = ",".join(map(str, nets))
    raise InfraError(
        f"no free /{PREFIX} subnet for a job network in {POOL_ENV}={spec} ({len(refused)} refused by Docker)",
        hint=f"widen {POOL_ENV} (comma-separated IPv4 CIDRs this host uses for nothing else), "
        "or remove networks left over (`fila recover`)",
    )
