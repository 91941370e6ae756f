"""What the addon needs of mitmproxy's own objects: answers and denials of flows, the checks of a
request's bytes, the DNS door, the sink, and the layers that hold or close a tunnel's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mitmproxy import dns, http, tcp
from mitmproxy.net.dns import response_codes
from mitmproxy.net.dns import types as dns_types
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events, layer

from .config import DNS_PORT, TLS_VERSIONS, logger

if TYPE_CHECKING:
    from fila_gateway import Gateway


def m_ok(flow: http.HTTPFlow) -> bool:
    return bool(flow.metadata.get("fila_metered"))


def json_response(status: int, reason: str, **extra: Any) -> http.Response:
    body = json.dumps({"error": {"type": "fila_gateway", "message": reason, **extra}}).encode()
    return http.Response.make(status, body, {"content-type": "application/json", "connection": "close"})


def _pieces(data: bytes) -> list[bytes]:
    """What a response's stream function returns: an empty bytes would go out as a chunk of its
    own, and an empty chunk ends a chunked body for the client; nothing to send is no chunk."""
    return [data] if data else []


def guarded(fn: Callable[[bytes], bytes]) -> Callable[[bytes], list[bytes]]:
    """A response's stream function that fails closed: once `fn` raises, nothing more of the
    answer goes to the engine (it gets a cut answer, never an unscrubbed one)."""
    broken = False

    def run(chunk: bytes) -> list[bytes]:
        nonlocal broken
        if not broken:
            try:
                return _pieces(fn(chunk))
            except Exception as e:
                logger.error(f"fila_gateway: response filter failed, the rest is dropped: {e!r}")
                broken = True
        return []

    return run


_UNSAFE_TARGET = re.compile(rb"[^\x21-\x7e]")  # control characters, space, non-ASCII
_UNSAFE_VALUE = re.compile(rb"[^\x20-\x7e]")  # a header value may hold spaces
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def unsafe_request(req: http.Request) -> str | None:
    """Why a route request's path, query, authority or headers are not plain printable ASCII, or
    its version is not one the upstream's HTTP/1.1 head is written in."""
    if req.data.http_version not in (b"HTTP/1.0", b"HTTP/1.1"):
        return "HTTP version other than 1.0 or 1.1"
    if _UNSAFE_TARGET.search(req.data.path) or _UNSAFE_TARGET.search(req.data.authority):
        return "control character, space or non-ASCII in the path or query"
    for name, value in req.headers.fields:
        if not _TOKEN.match(name):
            return "invalid header name"
        if _UNSAFE_VALUE.search(value):
            return "control character or non-ASCII in a header value"
    return None


def header_bytes(req: http.Request) -> int:
    return sum(len(k) + len(v) + 4 for k, v in req.headers.fields) + len(req.path or "") + len(req.host or "")


def fail_closed(deny: Callable[[Any, Any, str], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a hook; if it raises, refuse the flow it was deciding instead of letting it through
    (mitmproxy logs an addon's exception and carries on with the flow)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def run(self: Any, flow: Any) -> None:
            try:
                r = fn(self, flow)
                if asyncio.iscoroutine(r):
                    await r
            except Exception as e:
                logger.error(f"fila_gateway: {fn.__name__} failed, refusing: {e!r}")
                deny(self, flow, f"gateway error: {type(e).__name__}")

        return run

    return wrap


def deny_http(self: Gateway, flow: http.HTTPFlow, reason: str) -> None:
    if not flow.metadata.get("fila_logged"):
        flow.response = json_response(500, reason)
        self.record(flow, allowed=False, reason=reason, status=500)


def deny_response(self: Gateway, flow: http.HTTPFlow, reason: str) -> None:
    # Too late for an answer of the gateway's own (the upstream's body would be sent in it): the
    # flow is killed, and the engine's connection closed without a byte of the answer.
    flow.kill()
    self.record(flow, allowed=False, reason=reason, status=None)


def _deny_tcp(self: Gateway, flow: tcp.TCPFlow, reason: str) -> None:
    flow.kill()


async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        if await reader.read(65536):
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
    writer.close()


class DnsRefuser(asyncio.DatagramProtocol):
    """The DNS door: every query is answered REFUSED and logged; nothing is ever resolved."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        try:
            msg = dns.Message.unpack(data)
        except Exception:  # not DNS: nothing to answer
            return
        if not msg.query or self.transport is None or not self.gateway.client_allowed(str(addr[0])):
            return
        answer = msg.fail(response_codes.REFUSED).packed
        self.transport.sendto(answer, addr)
        for q in msg.questions or [None]:
            self.gateway.write(
                door="dns",
                method=dns_types.to_str(q.type) if q else None,
                host=q.name if q else None,
                port=DNS_PORT,
                reason="the engine resolves no names (the gateway does)",
                bytes_in=len(answer),
                bytes_out=len(data),
            )


def hello_problem(data: bytes) -> str | None:
    """Why the first client bytes of a tunnel are not (the start of) a TLS ClientHello: every
    record a handshake message, a known record version, not empty, the message a ClientHello.
    None: a ClientHello so far (complete or not)."""
    i = 0
    while len(data) - i >= 5:
        if data[i] != 0x16:
            return "not a TLS handshake"
        if data[i + 1 : i + 3] not in TLS_VERSIONS:
            return "unknown TLS record version"
        n = int.from_bytes(data[i + 3 : i + 5], "big")
        if n == 0 or n > 1 << 14:
            return "bad TLS record length"
        if i == 0 and len(data) > 5 and data[5] != 1:
            return "not a ClientHello"
        i += 5 + n
    if data and data[0] != 0x16:
        return "not a TLS handshake"
    return None


class AwaitClient(layer.Layer):
    """A tunnel's layer until its client's first bytes are checked: every event is kept (the
    server's first bytes too, never passed on) until `decide(client bytes so far)` gives the layer
    (a raw relay or a close), which then gets them all in order."""

    def __init__(self, context: Any, decide: Callable[[bytes], layer.Layer | None]) -> None:
        super().__init__(context)
        self.decide = decide
        self.kept: list[events.Event] = []
        self.child: layer.Layer | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.child is not None:
            yield from self.child.handle_event(event)
            return
        self.kept.append(event)
        if isinstance(event, events.ConnectionClosed) and event.connection == self.context.client:
            yield commands.CloseConnection(self.context.client)  # gone before it said anything
            return
        if not (isinstance(event, events.DataReceived) and event.connection == self.context.client):
            return
        data = b"".join(
            e.data
            for e in self.kept
            if isinstance(e, events.DataReceived) and e.connection == self.context.client
        )
        self.child = self.decide(data)
        if self.child is not None:
            kept, self.kept = self.kept, []
            for e in kept:
                yield from self.child.handle_event(e)


class CloseClient(layer.Layer):
    """A tunnel's next layer that only closes the client's connection (a refused handshake)."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


def sent_upstream(flow: http.HTTPFlow) -> int:
    """The bytes of `flow`'s request that left for its upstream: request line, headers (a route's
    real key among them) and body, as mitmproxy's HTTP/1 client writes them (`_http1.Http1Client`:
    an HTTP/2 request goes out as HTTP/1.1, a buffered chunked body as one chunk and the last).
    0 when no connection to the upstream was made: nothing left."""
    if flow.server_conn.timestamp_tcp_setup is None:
        return 0
    req = flow.request
    if req.is_http2 or req.is_http3:
        req = req.copy()
        req.http_version = "HTTP/1.1"
        if "Host" not in req.headers and req.authority:
            req.headers.insert(0, "Host", req.authority)
        req.authority = ""
        cookies = req.headers.get_all("Cookie")
        if len(cookies) > 1:
            req.headers["Cookie"] = "; ".join(cookies)
    body = req.raw_content or b""
    n = len(http1.assemble_request_head(req)) + len(body)
    if "chunked" in req.headers.get("transfer-encoding", "").lower():
        n += (len(b"%x\r\n\r\n" % len(body)) if body else 0) + len(b"0\r\n\r\n")
    return n
