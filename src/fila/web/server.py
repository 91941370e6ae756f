"""`fila serve`: where it listens, whether it may, and uvicorn serving the app (docs/review-web.md).

It binds 127.0.0.1 by default. Any address that is not a loopback address is refused unless the
root has an active account: without accounts a server would let anyone who reaches it decide.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..core.errors import InvalidInput
from ..core.layout import Root
from . import accounts

if TYPE_CHECKING:
    import uvicorn

    from ..queue.pg.store import PgQueue

DEFAULT_BIND = "127.0.0.1:8765"
# What clients may hold (docs/review-web.md, "Limits"): connections and requests at once (more
# are answered 503), an idle connection's life, and the time to send a request's headers (the
# body's is web/limits.BODY_DEADLINE_S).
CONCURRENCY = 64
KEEP_ALIVE_S = 5
HEADER_DEADLINE_S = 10.0


@dataclass(frozen=True)
class Bind:
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            # A name: loopback only if every address it resolves to is (an /etc/hosts may say
            # otherwise).
            try:
                found = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError:
                return False
            return bool(found) and all(ipaddress.ip_address(a[4][0]).is_loopback for a in found)
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a name: it may resolve anywhere
            return False

    def url(self, tls: bool) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if tls else 'http'}://{host}:{self.port}/"


def parse_bind(text: str) -> Bind:
    """HOST:PORT, [IPv6]:PORT or PORT (on 127.0.0.1)."""
    host, port = "127.0.0.1", text
    if text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        host, port = inner, rest.removeprefix(":")
    elif ":" in text:
        host, _, port = text.rpartition(":")
    try:
        n = int(port)
    except ValueError:
        n = -1
    if not host or not 0 <= n <= 65535:
        raise InvalidInput(f"--bind {text!r} is not HOST:PORT", hint=f"e.g. --bind {DEFAULT_BIND}")
    return Bind(host, n)


def check_bind(root: Root, bind: Bind, public_origin: str | None = None) -> None:
    """Refuse a bind beyond loopback, or a public origin (a proxy brings others in), when the root
    has no active account."""
    if bind.loopback and public_origin is None:
        return
    if not accounts.any_active(root):
        where = f"{bind.host} (not a loopback address)" if not bind.loopback else f"{public_origin} (a proxy)"
        raise InvalidInput(
            f"refusing to serve on {where} without accounts: anyone who reaches it could decide",
            hint="add an account first (`fila serve user add NAME`), or serve on 127.0.0.1",
        )


def parse_origin(text: str) -> str:
    """--public-origin: `https://HOST[:PORT]` (or http://), nothing after it; as browsers send it
    in `Origin`."""
    parts = urlsplit(text)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise InvalidInput(
            f"--public-origin {text!r} is not an origin",
            hint="e.g. --public-origin https://review.example.com",
        )
    return f"{parts.scheme}://{parts.netloc.lower()}"


def server(
    root: Root,
    db: PgQueue | None,
    bind: Bind,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    public_origin: str | None = None,
) -> tuple[uvicorn.Server, str]:
    """A uvicorn server of the app, once the bind is allowed (not started), and the path a person
    opens first: the one-time login link when the root has no active account, else `/`."""
    import uvicorn

    from .app import Config, make_app

    origin = parse_origin(public_origin) if public_origin is not None else None
    check_bind(root, bind, origin)
    if (certfile is None) != (keyfile is None):
        raise InvalidInput("--tls-cert and --tls-key go together", hint="pass both, or neither")
    cfg = Config(root=root, db=db, loopback=bind.loopback, public_origin=origin)
    app = make_app(cfg)
    config = uvicorn.Config(
        app,
        host=bind.host,
        port=bind.port,
        http=deadlined(),
        limit_concurrency=CONCURRENCY,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
        access_log=False,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        server_header=False,
        proxy_headers=False,
    )
    first = "/" if accounts.any_active(root) else cfg.local_link
    return uvicorn.Server(config), first


def deadlined() -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's headers: a connection that has
    not sent a whole request head HEADER_DEADLINE_S after it opened (or after its last answer) is
    closed, so a client trickling bytes cannot hold a connection (uvicorn's keep-alive timer
    stops at the first byte)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Deadlined(H11Protocol):
        answered = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.answered += 1
            self.arm()

        def arm(self) -> None:
            self.loop.call_later(HEADER_DEADLINE_S, self.late, self.answered)

        def late(self, answered: int) -> None:
            if answered == self.answered and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return Deadlined
