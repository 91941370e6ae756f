"""`fila mcp --http HOST:PORT`: the MCP server over streamable HTTP (docs/mcp.md).

On a loopback address (127.0.0.1, localhost, ::1) the SDK's DNS-rebinding protection checks Host
and Origin, and a token is optional (every local process reaches the port: a shared host wants
one); bound anywhere else every request must carry `Authorization: Bearer <token>` (the
operator's token, compared in constant time), since anyone who reaches the port could otherwise
queue tasks and read diffs.
"""

from __future__ import annotations

import hmac
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from ..core.errors import InvalidInput

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MIN_TOKEN_CHARS = 16


# The addresses the SDK guards against DNS rebinding (Host and Origin checked): only these count
# as loopback here, so every other bind (127.0.0.2 included) needs the token.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback(host: str) -> bool:
    return host in LOOPBACK


def parse_bind(value: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as `--http` takes it."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"--http {value!r} is not HOST:PORT", hint="e.g. --http 127.0.0.1:8765")
    return host.strip("[]"), int(port)


def check_token(host: str, token: str | None) -> None:
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise InvalidInput(
            f"the bearer token is {len(token)} characters: at least {MIN_TOKEN_CHARS}",
            hint="e.g. `openssl rand -hex 32 > token; chmod 600 token`",
        )
    if token is None and not loopback(host):
        raise InvalidInput(
            f"--http {host}: bound beyond this host, the MCP server needs a bearer token",
            hint="pass --token-file FILE (or set FILA_MCP_TOKEN), or bind 127.0.0.1",
        )


class Bearer:
    """ASGI middleware: an HTTP request without the token is answered 401, unread."""

    def __init__(self, app: App, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"www-authenticate", b"Bearer")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"fila mcp: a bearer token is required\n"})
                return
        await self.app(scope, receive, send)


def read_token(path: Path) -> str:
    """The bearer token from a file only its owner may read (as libpq's password file)."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read the token file: {e}", path=path) from None
    if st.st_mode & 0o077:
        raise InvalidInput(
            f"the token file is readable by others (mode {st.st_mode & 0o777:o})",
            path=path,
            hint=f"chmod 600 {path}",
        )
    return text


def serve(server: Any, host: str, port: int, token: str | None) -> None:
    """Serve until interrupted (uvicorn; its SIGINT and SIGTERM end it)."""
    import uvicorn

    check_token(host, token)
    if token is None:
        sys.stderr.write(
            "fila mcp: warning: no bearer token: any process on this host, of any user, can call the "
            "tools (--token-file FILE on a shared host)\n"
        )
    app: App = server.streamable_http_app(host=host)
    if token is not None:
        app = Bearer(app, token)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
