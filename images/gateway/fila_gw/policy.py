"""The destination check: which names are never allowed (reserved, IP literals), which allow entries
match a host and port, which resolved addresses are refused (private, loopback, the host's own).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from typing import Any

# Names that are never the public internet, listed or learned (defence in depth: the policy check
# on the host refuses the same names, fila.egress.config `_PRIVATE_NAMES` / `_PRIVATE_SUFFIXES`; a
# test keeps the two lists equal). A suffix is refused bare too (`arpa`, `internal`).
RESERVED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".lan", ".home.arpa", ".arpa")
RESERVED_NAMES = (
    "localhost",
    "localhost.localdomain",
    "ip6-localhost",
    "ip6-loopback",
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "instance-data",
)
HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$"
)
# Every form inet_aton() accepts as an address: 127.1, 2130706433, 0x7f000001, 0177.0.0.1.
NUMERIC_HOST = re.compile(r"^((0x[0-9a-f]*)|[0-9]+)(\.((0x[0-9a-f]*)|[0-9]+))*$")


# ---------------------------------------------------------------- host checks


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_problem(host: str) -> str | None:
    """Why a host name may not be asked for at all, before any allowlist lookup."""
    if is_ip(host) or NUMERIC_HOST.match(host):
        return "ip literal"
    if not HOSTNAME.match(host):
        return "invalid host"
    if host in RESERVED_NAMES or host.endswith(RESERVED_SUFFIXES) or "." + host in RESERVED_SUFFIXES:
        return "reserved name"
    return None


def matching_entries(allow: Iterable[dict[str, Any]], host: str, port: int) -> list[dict[str, Any]]:
    """Entries listing host:port: `host` exactly, or `*.suffix` for any name below suffix."""
    out = []
    for e in allow:
        pat = e["host"]
        hit = host.endswith(pat[1:]) if pat.startswith("*.") else host == pat
        if hit and e["port"] == port:
            out.append(e)
    return out


def address_problem(
    addr: str, allow_private: Iterable[ipaddress._BaseNetwork], host_addrs: Iterable[Any] = ()
) -> str | None:
    """Why a resolved address may not be connected to, or None when it is a public one (or a
    private one the config opens with allow_private). `host_addrs`: the addresses of the machine
    the gateway runs on (fila gives them): refused even when public (a wildcard entry resolving to
    the host would reach its services), unless allow_private names that very address (a /32)."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    nets = list(allow_private)
    if ip in host_addrs and not any(
        n.version == ip.version and n.prefixlen == n.max_prefixlen and ip in n for n in nets
    ):
        return f"address of the gateway's host {ip}"
    for kind, bad in (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),  # cloud metadata lives here
        ("multicast", ip.is_multicast),
        ("site-local", isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local),  # fec0::/10
    ):
        if bad:
            return f"{kind} address {ip}"
    if ip.is_global and not ip.is_private and not ip.is_reserved:
        return None
    if any(ip.version == net.version and ip in net for net in nets):
        return None
    return f"private address {ip}"


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for *_, sockaddr in infos:
        if sockaddr[0] not in seen:
            seen.append(sockaddr[0])
    return seen
