"""The job network's subnet chosen from FILA_JOB_SUBNETS (sandbox/docker/subnets.py): the pool
read and checked, this host's routes avoided, and, against the real daemon, a subnet another
network holds skipped, concurrent jobs given distinct subnets, a full pool said, and a spare's
gateway and namespace holder at their fixed addresses in it."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from fila.core.errors import InfraError
from fila.sandbox.base import run_as
from fila.sandbox.docker import egress, subnets
from tests.upstreams.fixtures import Upstreams

Net = ipaddress.IPv4Network
LABEL = {"fila.test": "job-subnets"}


def test_the_pool_is_read_from_the_variable_and_a_bad_one_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(subnets.POOL_ENV, raising=False)
    assert subnets.pool() == [Net(subnets.DEFAULT_POOL)]
    monkeypatch.setenv(subnets.POOL_ENV, " 10.1.0.0/24, 192.168.77.0/29 ")
    assert subnets.pool() == [Net("10.1.0.0/24"), Net("192.168.77.0/29")]
    monkeypatch.setenv(subnets.POOL_ENV, "docker")
    assert subnets.pool() is None  # Docker chooses
    for bad in ("10.1.0.0/30", "10.1.0.1/24", "fd00::/64", "nonsense", ""):
        with pytest.raises(InfraError, match=subnets.POOL_ENV) as e:
            subnets.pool(bad)
        assert e.value.hint and "CIDR" in e.value.hint


def test_this_hosts_routes_are_read_and_no_subnet_overlapping_them_or_a_taken_one_is_drawn(
    tmp_path: Path,
) -> None:
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"  # default: left out
        "eth0\t000A0A0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"  # 10.10.10.0/24
        "bad line\n"
    )
    routes = subnets.host_routes(table)
    assert routes == [Net("10.10.10.0/24")]
    pool = [Net("10.10.8.0/21")]
    left = subnets.free(pool, [*routes, Net("10.10.8.0/29")])
    rng = random.Random(7)
    drawn = {subnets.pick(left, rng) for _ in range(500)}
    assert all(d.prefixlen == subnets.PREFIX and d.subnet_of(pool[0]) for d in drawn)
    assert not [d for d in drawn if d.overlaps(Net("10.10.10.0/24")) or d == Net("10.10.8.0/29")]
    assert len(drawn) > 50  # spread over the pool, not the same few
    # The counterpart: without the route, its subnets are drawn too.
    assert any(d.subnet_of(Net("10.10.10.0/24")) for d in {subnets.pick(pool, rng) for _ in range(500)})
    assert subnets.free([Net("10.10.10.0/29")], routes) == []


@pytest.fixture
def networks(docker_client: docker.DockerClient) -> Iterator[list[str]]:
    """Names of networks the test made, removed after it."""
    made: list[str] = []
    yield made
    for name in made:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.api.remove_network(name)


def _free_pool(client: docker.DockerClient, size: int = 28) -> Net:
    """A /size the daemon and this host use for nothing (the tests' own corner of 10.0.0.0/8)."""
    taken = [*subnets.in_use(client), *subnets.host_routes()]
    for i in range(4096):
        net = Net((int(ipaddress.IPv4Address("10.200.0.0")) + (i << (32 - size)), size))
        if not any(net.overlaps(t) for t in taken):
            return net
    raise AssertionError("no free test range in 10.200.0.0/12")


def _create(client: docker.DockerClient, nets: list[Net], made: list[str]) -> subnets.JobSubnet:
    name = f"fila-test-subnets-{uuid.uuid4().hex[:8]}"
    net, chosen = subnets.create_network(client, name, nets, internal=True, labels=LABEL)
    made.append(name)
    net.reload()
    assert [c["Subnet"] for c in net.attrs["IPAM"]["Config"]] == [str(chosen.subnet)]
    return chosen


@pytest.mark.docker
def test_a_subnet_another_network_holds_is_skipped_and_a_full_pool_is_said(
    docker_client: docker.DockerClient, networks: list[str]
) -> None:
    pool = _free_pool(docker_client)  # two /29s
    low, high = pool.subnets(new_prefix=subnets.PREFIX)
    # Another network (not fila's) holds the low one: every job gets the high one.
    other = f"fila-test-subnets-other-{uuid.uuid4().hex[:8]}"
    docker_client.networks.create(
        other, internal=True, labels=LABEL,
        ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=str(low))]),
    )  # fmt: skip
    networks.append(other)
    got = _create(docker_client, [pool], networks)
    assert got.subnet == high and (got.gateway, got.holder) == (str(high[2]), str(high[3]))
    # Both taken: the pool is full, said with the variable to widen.
    with pytest.raises(InfraError, match=rf"no free /29 subnet .*{subnets.POOL_ENV}={pool}") as e:
        _create(docker_client, [pool], networks)
    assert e.value.hint and subnets.POOL_ENV in e.value.hint


@pytest.mark.docker
def test_concurrent_jobs_get_distinct_subnets_of_a_small_pool(
    docker_client: docker.DockerClient, networks: list[str]
) -> None:
    pool = _free_pool(docker_client, 27)  # four /29s, four jobs at once
    got: list[subnets.JobSubnet] = []
    errors: list[BaseException] = []

    def job() -> None:
        try:
            got.append(_create(docker.from_env(), [pool], networks))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=job) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(g.subnet for g in got) == list(pool.subnets(new_prefix=subnets.PREFIX))


@pytest.mark.docker
def test_a_spares_gateway_and_holder_start_at_their_fixed_addresses_and_leave_nothing(
    docker_client: docker.DockerClient,
    upstreams: Upstreams,
    gateway_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _free_pool(docker_client)
    monkeypatch.setenv(subnets.POOL_ENV, str(pool))
    uid, gid = run_as()
    gw = egress.create(docker_client, ident=f"test-subnets-{uuid.uuid4().hex[:8]}", labels=LABEL,
                       egress_network=upstreams.network, state=tmp_path / "gw", uid=uid, gid=gid,
                       netns=True)  # fmt: skip
    try:
        (subnet,) = gw.subnets
        assert Net(subnet).subnet_of(pool)
        chosen = subnets.JobSubnet(Net(subnet))
        assert egress.wait_ready(docker_client, gw, 60, markers=("listening",)) == chosen.gateway
        holder = docker_client.api.inspect_container(gw.netns)
        assert holder["State"]["Running"]
        assert holder["NetworkSettings"]["Networks"][gw.network]["IPAddress"] == chosen.holder
        assert holder["HostConfig"]["Dns"] == [chosen.gateway]  # its resolver: the gateway
    finally:
        egress.stop(docker_client, gw)
    assert not docker_client.api.containers(all=True, filters={"name": gw.container})
    assert not docker_client.api.networks(names=[gw.network])
