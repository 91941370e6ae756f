"""A runner "host" on a network of its own, for the partition tests (tests/test_pg_faults.py): a
network namespace joined to this machine by a veth pair, and a throwaway PostgreSQL cluster that
listens on TCP on the host end's address only. A partition is an nftables rule in the namespace
that drops every packet to and from the database (no reset: the runner learns nothing), and its
end is the rule's removal.

The namespace has no route off this machine: its one link reaches the host end of the veth, and
`Netns.check_isolated` proves it (no default route, no route to a public address) before the
first request. Root and `ip netns` are needed; `unavailable()` says why not, for a skip."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.pg import Cluster, pg_bindir


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why a network namespace cannot be made here (a skip's reason), or None."""
    if os.getuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on this machine (apt-get install iproute2 nftables)"
    name = f"fila-p{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        nft = subprocess.run(["ip", "netns", "exec", name, "nft", "list", "ruleset"],
                             capture_output=True, text=True)  # fmt: skip
        if nft.returncode != 0:
            return f"nftables does not work in a network namespace here: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Netns:
    """One namespace `name`, its end of the veth at `inner` (the runner's address), the host's
    end at `outer` (where the database listens)."""

    def __init__(self) -> None:
        used = _ip("-4", "-o", "addr", "show").stdout
        third = next(n for n in random.sample(range(1, 255), 254) if f" 10.213.{n}." not in used)
        tag = f"{os.getpid() % 10000}{third}"
        self.name = f"fila-t{tag}"
        self.host_dev, self.ns_dev = f"fh{tag}"[:15], f"fn{tag}"[:15]
        self.outer, self.inner = f"10.213.{third}.1", f"10.213.{third}.2"
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
            _ip("link", "set", self.ns_dev, "netns", self.name)
            _ip("addr", "add", f"{self.outer}/30", "dev", self.host_dev)
            _ip("link", "set", self.host_dev, "up")
            _ip("addr", "add", f"{self.inner}/30", "dev", self.ns_dev, ns=self.name)
            _ip("link", "set", self.ns_dev, "up", ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
        except BaseException:
            self.close()
            raise

    def check_isolated(self) -> None:
        """Assert the namespace can reach nothing but the host's end of its veth: no default
        route in either family, a public address unreachable, and the host's end reachable."""
        for family in ("-4", "-6"):
            routes = _ip(family, "route", "show", "table", "all", ns=self.name).stdout
            assert "default" not in routes, f"namespace {self.name} has a default route:\n{routes}"
        for public in ("1.1.1.1", "2606:4700:4700::1111"):
            got = _ip("route", "get", public, ns=self.name, check=False)
            assert got.returncode != 0, f"namespace {self.name} has a route to {public}: {got.stdout}"
        via = _ip("route", "get", self.outer, ns=self.name).stdout
        assert f"dev {self.ns_dev}" in via, via

    def argv(self, *argv: str) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def reaches(self, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from the namespace to the host's end, `port`, is made within
        `timeout` seconds (False also when it is refused)."""
        probe = f"exec 3<>/dev/tcp/{self.outer}/{port}"
        argv = self.argv("timeout", str(timeout), "bash", "-c", probe)
        return subprocess.run(argv, capture_output=True, timeout=timeout + 30).returncode == 0

    def cut(self) -> None:
        """The partition: every packet between the namespace and the database dropped, silently."""
        rules = (
            "table inet fila_cut {\n"
            "  chain out { type filter hook output priority 0; policy accept; "
            f"ip daddr {self.outer} drop; }}\n"
            "  chain in { type filter hook input priority 0; policy accept; "
            f"ip saddr {self.outer} drop; }}\n"
            "}\n"
        )
        subprocess.run(self.argv("nft", "-f", "-"), input=rules, text=True, check=True, timeout=30)

    def heal(self) -> None:
        """The partition ends: packets flow again (connections that outlived it carry on). A
        no-op when there is no partition."""
        tables = subprocess.run(self.argv("nft", "list", "tables"), capture_output=True, text=True,
                                check=True, timeout=30).stdout  # fmt: skip
        if "fila_cut" in tables:
            subprocess.run(self.argv("nft", "delete", "table", "inet", "fila_cut"), check=True, timeout=30)

    def close(self) -> None:
        """The namespace and its veth pair removed (the kernel drops the peer with it)."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, timeout=30)


class TcpCluster(Cluster):
    """Tests/support/pg.py's cluster, also listening on TCP on one address (`listen`, port
    `port`), accepting (trust) the clients of `subnet`."""

    def __init__(
        self, bindir: Path, base: Path, user: str | None, listen: str, port: int, subnet: str
    ) -> None:
        super().__init__(bindir, base, user)
        self.listen, self.port, self.subnet = listen, port, subnet

    def init(self) -> None:
        super().init()
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(f"listen_addresses = '{self.listen}'\nport = {self.port}\n")
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {self.subnet} trust\n")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql:///{dbname}?host={self.sock}&port={self.port}&user=postgres"

    def tcp(self, url: str) -> str:
        """The same database's URL over TCP, as the namespace reaches it."""
        return url.replace(f"host={self.sock}", f"host={self.listen}")


@contextlib.contextmanager
def partitionable() -> Iterator[tuple[Netns, TcpCluster]]:
    """A namespace and a started cluster on its host end's address, removed at the end."""
    bindir = pg_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL server: run scripts/postgres-up (apt-get install postgresql)")
    ns = Netns()
    user = "nobody" if os.getuid() == 0 else None
    base = Path(tempfile.mkdtemp(prefix="fila-pgns-"))
    if user:
        shutil.chown(base, user)
    subnet = ns.outer.rsplit(".", 1)[0] + ".0/30"
    c = TcpCluster(bindir, base, user, ns.outer, random.randrange(20000, 30000), subnet)
    try:
        c.init()
        c.start()
        yield ns, c
    finally:
        c.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)
        ns.close()
