"""`fila mcp --http HOST:PORT`: the MCP server over streamable HTTP (docs/mcp.md).

Every request must carry `Authorization: Bearer <token>` (compared in constant time), whatever
the bind: on loopback too every local process of every user reaches the port, and could
otherwise queue tasks, read the project through a task's log and decide. The token is the
operator's (`--token-file`, $FILA_MCP_TOKEN), else one fila generates once into
`<root>/fila/state/mcp.token` (mode 0600; fila/ is never copied into a task). On a loopback
address (127.0.0.1, localhost, ::1) the SDK's DNS-rebinding protection also checks Host and Origin.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import InvalidInput
from ..core.layout import Root
from ..core.stored import NotTrusted, owned_bytes

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MIN_TOKEN_CHARS = 16
# The token fila generates when the operator gives none: in the root's state, beside what only
# fila's uid reads.
TOKEN_FILE = "mcp.token"


def parse_bind(value: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as `--http` takes it."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"--http {value!r} is not HOST:PORT", hint="e.g. --http 127.0.0.1:8765")
    return host.strip("[]"), int(port)


def check_token(token: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidInput(
            f"the bearer token is {len(token)} characters: at least {MIN_TOKEN_CHARS}",
            hint="e.g. `openssl rand -hex 32 > token; chmod 600 token`",
        )
    return token


def the_token(root: Root, token_file: Path | None, given: str | None) -> tuple[str, Path | None]:
    """The bearer token every request must carry: from `token_file`, else `given` (the
    environment's), else the root's generated one (made now when it is not there yet, mode 0600).
    Returns it and the generated file's path (None for the operator's own)."""
    if token_file is not None:
        return check_token(read_token(token_file)), None
    if given:
        return check_token(given), None
    path = root.state_dir / TOKEN_FILE
    fsutil.create_exclusive(path, secrets.token_hex(32) + "\n", mode=0o600)  # False: kept from before
    return check_token(read_token(path)), path


class Bearer:
    """ASGI middleware: an HTTP request without the token is answered 401, unread. The scheme's
    name is matched case-insensitively (RFC 9110), the token in constant time."""

    def __init__(self, app: App, token: str) -> None:
        self.app, self.expected = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scheme, _, got = dict(scope.get("headers") or []).get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(got.strip(b" "), self.expected) and scheme.lower() == b"bearer"):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"www-authenticate", b"Bearer")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"fila mcp: a bearer token is required\n"})
                return
        await self.app(scope, receive, send)


def read_token(path: Path) -> str:
    """The bearer token from a file only its owner (this uid) may read, as libpq's password file:
    opened without following a link, checked on the open descriptor (owner, mode)."""
    try:
        data = owned_bytes(str(path), os.geteuid(), private=True)
        return data.decode().strip()
    except NotTrusted as e:
        raise InvalidInput(f"the token file is not to be trusted: {e}", path=path,
                           hint=f"chmod 600 {path} (owned by you, not a link)") from None  # fmt: skip
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read the token file: {e}", path=path) from None


def listen(host: str, port: int) -> socket.socket:
    """The bound, listening socket: a bind that fails (the port taken, an unknown host) is refused
    before anything says it serves."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise InvalidInput(f"--http {host}:{port}: {e}", hint="give an address of this host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise InvalidInput(f"cannot listen on {host}:{port}: {e.strerror or e}",
                           hint="choose another port, or stop what listens there") from None  # fmt: skip
    return sock


def serve(server: Any, host: str, port: int, token: str, listening: Callable[[], None]) -> None:
    """Serve until interrupted (uvicorn; its SIGINT and SIGTERM end it); `listening` is called
    once the port is bound."""
    import uvicorn

    sock = listen(host, port)
    app: App = Bearer(server.streamable_http_app(host=host), token)
    listening()
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
