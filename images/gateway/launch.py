"""Binds the gateway's listening sockets, then becomes its proxy (serve.py: mitmproxy with fila's
addon; entrypoint.sh runs this).

The proxy takes a few tenths of a second to import before it listens (docs/benchmarks.md, "The
one-shot path"). The sockets are bound here first, in a few milliseconds: the proxy and route
doors (TCP, listening) and the DNS door (UDP), handed to the proxy as inherited descriptors named in
FILA_GATEWAY_SOCKETS (`tcp:3128=3,tcp:8080=4,udp:53=5`). `listening` is written in the log directory
once they exist: from then on the host may start the engine, whose connections and lookups wait
in the sockets' queues until the addon has its config and serves them (fila_gateway.py takes the
descriptors over once configured, then writes `ready`). Nothing is accepted before that: no
request is read, refused or passed by a gateway without its job's policy.

Run with the interpreter's `-S` (no site-packages: nothing here needs them). Extra arguments are
serve.py's (`--set NAME=VALUE` pairs of mitmproxy options).
"""

import os
import socket
import sys
from pathlib import Path

LOG_DIR = Path(os.environ.get("FILA_GATEWAY_LOG_DIR", "/var/log/fila-gateway"))
PROXY_PORT = int(os.environ.get("FILA_GATEWAY_PROXY_PORT", "3128"))
ROUTE_PORT = int(os.environ.get("FILA_GATEWAY_ROUTE_PORT", "8080"))
DNS_PORT = int(os.environ.get("FILA_GATEWAY_DNS_PORT", "53"))
BACKLOG = 1024  # an engine's connections made before the proxy serves wait here


def tcp_listeners(host: str, port: int) -> list[socket.socket]:
    """What asyncio.start_server(host, port) binds (mitmproxy's own listen): one socket per
    address of `host` (every address for ""), IPv6 ones IPv6-only. An IPv6 address the container
    lacks is skipped; the IPv4 one must bind."""
    out = []
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        s = socket.socket(family, kind, proto)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind(addr)
        except OSError:
            s.close()
            if family == socket.AF_INET6:
                continue
            raise
        s.listen(BACKLOG)
        out.append(s)
    return out


def dns_door() -> socket.socket | None:
    """The DNS door's socket; without net.ipv4.ip_unprivileged_port_start <= 53 there is none
    (the addon says so: lookups then go unanswered and unlogged)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("0.0.0.0", DNS_PORT))
    except OSError:
        s.close()
        return None
    return s


def main() -> None:
    host = os.environ.get("FILA_GATEWAY_LISTEN_HOST", "")
    held = [(f"tcp:{port}", s) for port in (PROXY_PORT, ROUTE_PORT) for s in tcp_listeners(host, port)]
    if (udp := dns_door()) is not None:
        held.append((f"udp:{DNS_PORT}", udp))
    for _, s in held:
        s.set_inheritable(True)
    os.environ["FILA_GATEWAY_SOCKETS"] = ",".join(f"{name}={s.fileno()}" for name, s in held)
    try:
        tmp = LOG_DIR / ".listening.tmp"
        tmp.write_text("bound\n")
        tmp.replace(LOG_DIR / "listening")
    except OSError as e:  # no log directory to write (a gateway run by hand): the host sees no marker
        print(f"fila_gateway: cannot write {LOG_DIR / 'listening'}: {e.strerror}", file=sys.stderr)
    serve = str(Path(__file__).resolve().parent / "serve.py")
    os.execvp("python3", ["python3", serve, *sys.argv[1:]])


if __name__ == "__main__":
    main()
