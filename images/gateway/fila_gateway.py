"""fila's egress gateway: a mitmproxy addon that is the policy, the log and the meter.

mitmproxy does all the HTTP and TLS work. This addon decides, per request, whether it may pass:

- door "proxy" (forward proxy, regular mode on 3128): CONNECT only to a listed host:port without a
  method list, tunnelled raw (never intercepted: the engine trusts no gateway CA) once its first
  bytes are a clean TLS ClientHello for that host; plain-HTTP absolute-URL requests with the same
  checks plus the entry's method list. The name is resolved here, every address must be
  global (or inside `allow_private`), and the connection is pinned to the checked address so that a
  second lookup (DNS rebinding) cannot change where it goes.
- door "route" (reverse mode on 8080, plain HTTP/1 only: a client starting TLS is closed, HTTP/2 is
  off): `/<route>/<rest>` goes to the route's upstream with the engine's credential headers (and
  method or URL override headers) dropped and the real one (from the secrets directory) added, for
  the route's `paths` only (no upgrades, no escapes, no body on GET or HEAD, nothing but printable
  ASCII in the target and the header values), to an address the gateway resolved and checked as
  the proxy door does and pinned, the upstream's name its Host and TLS server name; usage is read from
  model-call responses (streams stay streamed) and the job's budget is enforced before forwarding
  (one model call at a time under max_tokens; a model call without readable usage spends the
  budget). The answer never carries the credential back: every form of a route's key the upstream
  echoes (status line, headers, body, trailers; as is, percent-encoded once or twice, JSON- or
  `\\xHH`-escaped, HTML character references, hex, base64 with or without line breaks or spaces;
  split across chunks, stream events, or JSON strings a client joins, in an event stream, a JSON
  body, JSON lines or a JSON array of chunks) is replaced by a marker of the same length before the
  engine reads it (`Needles`, `StreamScrubber`, `SseScrubber`), a compressed answer is refused
  (the gateway asks for identity), an answer whose head cannot be parsed becomes the gateway's own
  502 (mitmproxy's error page would quote it), an interim or protocol-switching answer (1xx) is
  refused and the connection closed, and each replacement
  is counted per kind in the call's line and the route's totals. Not recognised: the key in UTF-16
  or in base32, hex with separators, XOR or any encoding a colluding engine and upstream agree on,
  a gzip body labelled only by its Content-Type (no Content-Encoding), a key split across two
  headers (or across a header and the body), a key inside one event past MAX_SSE_LINE split with
  the events around it, a key split across strings the client puts in another order than they
  came (OpenAI chunks whose `index` values go out of order). A route name that is not configured is a
  denied request, never a route of the totals.
- Learning (config `learn`, set only from the operator's policy file): a name no entry lists,
  on one of `learn.ports`, is let through the proxy door instead of refused "not in allowlist",
  and its line says `learned: true`. Nothing else changes: the same `_check_destination` still
  refuses IP literals, reserved names and every address `address_problem` refuses (private,
  loopback, link-local and metadata, the host's own), and the DNS door still refuses the engine's
  lookups. Each name asked to be learned counts against `budget.max_requests` (shared with the
  route calls, which fila requires of a learning policy) before it is looked up, whether it then
  passes or not: past it, 429 and no lookup. A refused one tells the engine "destination refused"
  (the address it resolved to is the log's only). Learned lines are written past LOG_CAP.
- The proxy door adds no credential (a tunnel carries the engine's own TLS, a plain request its
  own headers): there is nothing of fila's to scrub in what comes back through it.

The addon is this file and the package beside it (fila_gw/), by role: `config` (settings and the
config file), `policy` (the destination check), `meter` and `jsonvalues` (usage), `scrub` (the
scrubber), `record` (the log and the summary: `Recorder`), `proxydoor` (`ProxyDoor`), `routes`
(`RouteDoor`) and `wire` (mitmproxy's objects: answers, denials, the DNS door, tunnel layers).
`Gateway` below is the addon: its state, its life cycle, the hooks both doors share, and the
patches of mitmproxy that need it.

Every decision is one JSON line in egress.jsonl (a route call's twice: in flight, then final, same
`id`), up to LOG_CAP; summary.json holds the totals, rewritten atomically. The addon fails closed:
a config it cannot load stops mitmdump at start-up, and an exception inside a hook refuses the
request it was deciding.

The container (images/gateway, run as any non-root uid, read-only root, tmpfs /tmp):
- /etc/fila-gateway/config.json (ro): {"job", "allow": [{"host": "name" | "*.suffix", "port",
  "methods": null | [..]}], "allow_private": [CIDR], "routes": {name: {"upstream": URL, "header",
  "format": "...{key}...", "secret": file name, "paths": null | ["METHOD /path"]}},
  "budget": {"max_requests", "max_tokens"}, "upstream_ca": path | null, "clients": [CIDR] | null
  (optional: who may connect; fila gives the job network), "host_addresses": [IP] (optional: the
  host's own addresses, never connected to), "learn": null | {"ports": [port]} (optional: let
  unlisted names through on these ports, logged as learned)};
- /run/fila-gateway/secrets/<secret> (ro): one credential per file, read once at start;
- /var/log/fila-gateway/ (rw): egress.jsonl (one line per decision, fields in `Gateway.write`),
  summary.json (`Gateway._summarize`) and `ready`, written once both listeners are bound and the
  config is loaded;
- ports 3128 (proxy) and 8080 (routes); entrypoint.sh starts mitmdump through launch.py, which
  binds the doors' sockets first and writes `listening` (mitmdump's start-up is most of a gateway's
  cost): the addon takes them over (FILA_GATEWAY_SOCKETS) only once it has its config, so an
  engine started meanwhile waits in their queues and is never refused for a config not yet read;
- FILA_GATEWAY_WAIT=1 (a spare, started before its job): with no config.json yet it serves no one
  (its sockets, bound by launch.py, are not accepted from; without them, mitmproxy's own listeners
  refuse every client and request) and loads config.json (the host mounts /etc/fila-gateway as a
  directory and writes the secrets first, then the config, renamed into place) as soon as it
  appears; a bad one makes it exit. A spare serves one job at most: the host removes it after that
  job.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import re
import socket
from typing import Any

from fila_gw.config import (
    CONFIG_PATH,
    CONFIG_POLL_S,
    DNS_PORT,
    LOG_DIR,
    LOG_FIELD,
    MAX_HEAD_READ,
    MAX_HEADER_BYTES,
    PROXY_PORT,
    ROUTE_PORT,
    SINK_PORT,
    SOCKETS,
    SYSTEM_CA,
    WAIT,
    ConfigError,
    load_config,
    logger,
)
from fila_gw.proxydoor import ProxyDoor
from fila_gw.record import Recorder, escaped, mark, new_totals
from fila_gw.routes import RouteDoor
from fila_gw.scrub import Needles
from fila_gw.wire import DnsRefuser, deny_http, fail_closed, header_bytes, json_response, sink
from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1, status_codes
from mitmproxy.proxy import commands, events, layer, mode_servers
from mitmproxy.proxy.layers.http import ResponseProtocolError, _http1
from mitmproxy.proxy.mode_specs import ReverseMode

# What the gateway answers in place of mitmproxy's error page (which quotes what it could not
# read: an upstream's answer, with the credential it echoes), per status.
ERROR_ANSWERS = {
    502: "no readable answer from the upstream (the reason is in the gateway's log)",
    413: "request body too large",
    400: "bad request",
}

_read_request_head = _http1.Http1Server.read_headers
_http1_server_send = _http1.Http1Server.send


def _door_of(conn: Any) -> str:
    return "route" if isinstance(getattr(conn, "proxy_mode", None), ReverseMode) else "proxy"


def _bounded_read_headers(self: Any, event: events.Event) -> layer.CommandGenerator[None]:
    """mitmproxy's HTTP/1 server reads a request head without a limit ("FIXME: protect against
    header size DoS"): one huge header would fill the gateway's memory and kill it with every
    in-flight request's usage. Past MAX_HEAD_READ bytes without the blank line: 431 and close.
    A head mitmproxy cannot parse (a bad request line, a header line without a colon, a folded or
    nameless one) gets its 400 before any hook sees the request: it is logged here, with why."""
    if isinstance(event, events.DataReceived) and len(self.buf) > MAX_HEAD_READ:
        head = bytes(self.buf._data[: MAX_HEAD_READ + 4])
        if b"\r\n\r\n" not in head and b"\n\n" not in head:
            yield commands.SendData(self.conn, _http1.make_error_response(431, "request headers too large"))
            yield commands.CloseConnection(self.conn)
            with contextlib.suppress(Exception):  # refused before any hook: logged here
                addons[0].write(
                    door=_door_of(self.conn),
                    reason=f"request headers larger than {MAX_HEAD_READ} bytes",
                    status=431,
                )
            self.buf._data.clear()
            self.state = self.done
            return
    had_request = self.request is not None
    inner = _read_request_head(self, event)
    reply: Any = None
    refused = False
    while True:
        try:
            cmd = inner.send(reply)
        except StopIteration:
            return
        if isinstance(cmd, commands.SendData) and not had_request and self.request is None:
            refused = cmd.data.startswith(b"HTTP/1.1 400")
        elif isinstance(cmd, commands.Log) and refused:
            with contextlib.suppress(Exception):
                _log_malformed(self.conn, cmd.message)
        reply = yield cmd


def _log_malformed(conn: Any, message: str) -> None:
    # mitmproxy's message is "<peer>: <why>"; a bad request line names its method and target.
    why = message.split(": ", 1)[1] if ": " in message else message
    m = re.search(r"Bad HTTP request line: b'(?P<method>[^ ']{1,24}) (?P<target>[^ ']{1,300})", why)
    addons[0].write(
        door=_door_of(conn),
        method=m["method"] if m else None,
        host=m["target"] if m else None,
        reason=f"malformed request: {why}",
        status=400,
    )


def _own_error_answer(self: Any, event: Any) -> layer.CommandGenerator[None]:
    """mitmproxy answers a flow that failed (an upstream answer it cannot parse, a connection
    refused, a body too large) with an HTML page quoting the error, and the error quotes the
    upstream's bytes: a route's credential, when the upstream echoes it in a broken head. The
    client gets the gateway's own JSON error instead: the status only, no upstream byte."""
    if (
        isinstance(event, ResponseProtocolError)
        and event.code != status_codes.NO_RESPONSE
        and not self.response
        and self.conn.state & ConnectionState.CAN_WRITE
    ):
        reason = ERROR_ANSWERS.get(event.code, status_codes.RESPONSES.get(event.code, "error"))
        yield commands.SendData(self.conn, http1.assemble_response(json_response(event.code, reason)))
        yield commands.CloseConnection(self.conn)
        return
    yield from _http1_server_send(self, event)


_http1.Http1Server.read_headers = _bounded_read_headers  # type: ignore[method-assign]
_http1.Http1Server.send = _own_error_answer  # type: ignore[method-assign]


class Gateway(Recorder, ProxyDoor, RouteDoor):
    """The addon: one per mitmdump process, so one per job (its counters are the job's budget)."""

    def __init__(self) -> None:
        self.config: dict[str, Any] | None = None
        self.requests = 0
        self.tokens = 0
        self.tunnels: dict[str, dict[str, Any]] = {}
        self._log: Any = None
        self._sink: asyncio.Server | None = None
        self._dns: Any = None
        self._slot: asyncio.Lock | None = None  # one metered call at a time under max_tokens
        self.in_flight = 0
        self._log_bytes = 0
        # Totals that never depend on the log fitting its cap (summary.json, rewritten atomically).
        self.totals: dict[str, Any] = new_totals()
        self._summary_at = 0.0
        self.needles = Needles(())  # the route credentials, in every form a response must not carry
        self._waiting: asyncio.Task[None] | None = None  # the wait to serve (a spare's: for its config)
        self._prepared: asyncio.Future[bool] | None = None
        # Per route client: the checked address each route request was pinned to, and the
        # upstream's name its TLS must be for (RouteDoor.server_connect).
        self.route_names: dict[str, dict[tuple[str, int], str]] = {}

    # -- lifecycle

    def load(self, loader: Any) -> None:
        if WAIT and not CONFIG_PATH.exists():
            return  # a spare: its config arrives once a job takes it (`running` waits for it)
        self._configure()

    def _configure(self) -> bool:
        """Read the config and the credentials, open the log. False (logged as an error) when the
        config is bad: at start-up that makes mitmdump exit (errorcheck); a spare exits itself."""
        try:
            self.config = load_config()
        except ConfigError as e:
            # An error logged at start-up makes mitmdump exit (errorcheck): no gateway without policy.
            logger.error(f"fila_gateway: {e}")
            return False
        self.needles = Needles(n for r in self.config["routes"].values() for n in r["needles"])
        # A spare's refusals before its job (nobody's: its job network was empty) are not the job's.
        self.totals = new_totals()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self._log = open(LOG_DIR / "egress.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._log_bytes = self._log.tell()
        return True

    def prepared(self) -> asyncio.Future[bool]:
        """Configured and ready to serve (the same future for every door that asks): False when
        the config was bad (the gateway is shutting down)."""
        if self._prepared is None:
            self._prepared = asyncio.ensure_future(self._prepare())
        return self._prepared

    async def _prepare(self) -> bool:
        """The config (a spare: waited for, looked for every 10 ms), the reverse listener's sink,
        the DNS door and the upstream CA: everything a request needs, before a door accepts one."""
        if self.config is None:
            if not WAIT:
                return False  # a bad config at start-up: mitmdump is exiting (errorcheck)
            if not SOCKETS:
                # mitmproxy's own listeners are up already: they refuse everything ("gateway has
                # no config", "client not on the job network") until the config is there.
                mark(LOG_DIR / "listening")
            while not CONFIG_PATH.exists():
                await asyncio.sleep(CONFIG_POLL_S)
            if not self._configure():
                ctx.master.shutdown()  # a spare given a bad config serves no one: the host sees it exit
                return False
        # The reverse listener's nominal target: mitmproxy connects there when a route client
        # connects (eager strategy), and never sends a request there (the addon sends each to its
        # route's upstream). Should one ever arrive, it gets a 502, not a hang.
        self._sink = await asyncio.start_server(sink, "127.0.0.1", SINK_PORT)
        # The DNS door: the engine's resolver is the gateway, which answers every query REFUSED
        # (it never resolves for the engine: no DNS channel out) and logs it. Binding 53 as a
        # non-root user needs net.ipv4.ip_unprivileged_port_start <= 53 on the container; without
        # it the engine's lookups fail unanswered, just unlogged.
        door = SOCKETS.pop(f"udp:{DNS_PORT}", None)
        where: dict[str, Any] = (
            {"sock": socket.socket(fileno=door[0])} if door else {"local_addr": ("0.0.0.0", DNS_PORT)}
        )
        try:
            self._dns, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: DnsRefuser(self), **where
            )
        except OSError as e:
            logger.warning(
                f"fila_gateway: no DNS door on port {DNS_PORT} ({e.strerror}); lookups go unlogged"
            )
        # mitmproxy's own TLS to a route upstream: the configured CA, else the system bundle (which
        # holds the build-time extra CA), never certifi's copy.
        assert self.config is not None
        ctx.options.update(ssl_verify_upstream_trusted_ca=self.config["upstream_ca"] or SYSTEM_CA)
        return True

    async def running(self) -> None:
        self._waiting = asyncio.create_task(self._serve_when_prepared())

    async def _serve_when_prepared(self) -> None:
        if await self.prepared():
            self._serve()

    def _serve(self) -> None:
        """Configured and listening: `ready` written for the host."""
        ps = ctx.master.addons.get("proxyserver")
        ports = {addr[1] for addr in ps.listen_addrs()} if ps else set()
        if {PROXY_PORT, ROUTE_PORT} <= ports:
            mark(LOG_DIR / "ready")
        else:
            logger.error(f"fila_gateway: listeners {sorted(ports)} lack {PROXY_PORT} or {ROUTE_PORT}")

    def done(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
        if self._sink is not None:
            self._sink.close()
        if self._dns is not None:
            self._dns.close()
        self._summarize(force=True)
        if self._log is not None:
            self._log.close()

    def client_allowed(self, peer: str) -> bool:
        """Whether `peer` may use this gateway (and its credentials): with `clients` set to the
        job network, nothing from elsewhere (another job's gateway on the egress network, reached
        through a broad allow_private) gets a request read."""
        nets = self.config["clients"] if self.config else []
        if nets is None:
            return True
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(peer.split("%", 1)[0])
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            return any(ip.version == n.version and ip in n for n in nets)
        return False

    def client_connected(self, client: Any) -> None:
        peer = client.peername[0] if client.peername else ""
        if self.client_allowed(peer):
            return
        client.error = "client not on the job network"
        door = "route" if isinstance(client.proxy_mode, ReverseMode) else "proxy"
        self.write(door=door, host=peer, reason=f"client {peer} not on the job network")

    def refuse(self, flow: http.HTTPFlow, status: int, reason: str, **extra: Any) -> None:
        flow.response = json_response(status, reason, **extra)
        self.record(flow, allowed=False, reason=reason, status=status)

    # -- both doors: every HTTP request that is not a CONNECT

    @fail_closed(deny_http)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        if self.config is None:
            return self.refuse(flow, 503, "gateway has no config")
        if flow.error is not None:
            # mitmproxy already refused it (smuggling-prone headers: both Content-Length and
            # Transfer-Encoding, ...) and answers 400 itself; this hook only lets it be seen.
            flow.metadata.update(fila_door=self._door(flow), fila_path=escaped(flow.request.path))
            return self.record(
                flow, allowed=False, reason=f"refused by the proxy: {flow.error.msg}"[:LOG_FIELD], status=400
            )
        if header_bytes(flow.request) > MAX_HEADER_BYTES:
            flow.metadata["fila_door"] = self._door(flow)
            return self.refuse(flow, 431, f"headers larger than {MAX_HEADER_BYTES} bytes")
        if isinstance(flow.client_conn.proxy_mode, ReverseMode) or self._to_own_routes(flow):
            return await self._route_request(flow)
        await self._proxy_request(flow)

    def _to_own_routes(self, flow: http.HTTPFlow) -> bool:
        """An absolute-URL request on the proxy port for this gateway's own route port: an engine
        that sent its model URL to the proxy (NO_PROXY not honoured). Served as a route request."""
        sock = flow.client_conn.sockname
        return bool(sock) and flow.request.port == ROUTE_PORT and flow.request.host == sock[0]

    def _door(self, flow: http.HTTPFlow) -> str:
        return (
            "route"
            if isinstance(flow.client_conn.proxy_mode, ReverseMode) or self._to_own_routes(flow)
            else "proxy"
        )

    @fail_closed(deny_http)
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("fila_logged") or not flow.metadata.get("fila_chat"):
            return
        # OpenAI sends a chat stream's usage only when asked (stream_options.include_usage): ask,
        # so that every streamed chat call is metered.
        try:
            body = json.loads(flow.request.get_content() or b"null")
        except ValueError:
            return self.refuse(flow, 400, "chat completions body is not JSON")
        if isinstance(body, dict) and body.get("stream") is True:
            opts = body.get("stream_options")
            body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            flow.request.set_content(json.dumps(body).encode())

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("fila_logged"):
            return
        if flow.request.method == "CONNECT":
            if isinstance(flow.client_conn.proxy_mode, ReverseMode):
                # mitmproxy refuses a CONNECT on the route port before any hook sees it: no
                # tunnel will log it, so this is its line.
                flow.metadata.update(fila_door="route", fila_path=escaped(flow.request.path))
                msg = flow.error.msg if flow.error else "error"
                return self.record(
                    flow, allowed=False, reason=f"CONNECT on the route port: {msg}"[:LOG_FIELD], status=400
                )
            return  # a tunnel is logged when it ends (tcp_end / tcp_error)
        msg = flow.error.msg if flow.error else "error"
        if flow.request.timestamp_end is None:
            # The request never arrived whole (malformed, smuggled, too large, or the client
            # went away), so it was never sent: mitmproxy answered the engine itself.
            if flow.metadata.get("fila_in_flight"):
                self.requests -= 1  # the budget counts what reached the upstream
            if "disconnected" in msg:
                self.record(flow, allowed=False, reason=f"incomplete request: {msg}", status=None)
            else:
                status = 413 if "body_size_limit" in msg else 400
                self.record(flow, allowed=False, reason=f"refused by the proxy: {msg}", status=status)
            return
        if msg.startswith("Client disconnected"):
            # The engine went away while waiting (or reading): the upstream is not to blame.
            when = "before the answer" if flow.response is None else "during the answer"
            status = flow.response.status_code if flow.response else None
            self.record(flow, allowed=True, reason=f"client disconnected {when}", status=status)
            return
        # No (readable) answer from the upstream: the engine gets the gateway's own 502
        # (_own_error_answer); the reason quotes the upstream's bytes, scrubbed by `write`.
        status = flow.response.status_code if flow.response else 502
        self.record(flow, allowed=True, reason=f"upstream: {msg}", status=status)


addons = [Gateway()]

_asyncio_listen = mode_servers.AsyncioServerInstance.listen


async def _listen(self: Any, host: str, port: int) -> list[Any]:
    """A door whose socket launch.py bound starts accepting from it only once the addon is
    prepared (its config read, its sink, DNS door and upstream CA set): connections made before
    wait in the socket's queue. Any other listener is mitmproxy's own."""
    fds = SOCKETS.pop(f"tcp:{port}", None) if self.mode.transport_protocol == "tcp" else None
    if not fds:
        return list(await _asyncio_listen(self, host, port))
    if not await addons[0].prepared():
        for fd in fds:
            os.close(fd)
        return []
    return [await asyncio.start_server(self.handle_stream, sock=socket.socket(fileno=fd)) for fd in fds]


mode_servers.AsyncioServerInstance.listen = _listen  # type: ignore[method-assign]
