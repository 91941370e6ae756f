"""Door "proxy" (the forward proxy on 3128): CONNECT checked against the allow list and tunnelled
raw once the client's first bytes are a clean ClientHello, and plain-HTTP requests checked the same
way (`ProxyDoor`, a part of the addon).
"""

from __future__ import annotations

import functools
from typing import Any

from mitmproxy import http, tcp
from mitmproxy.net.http import url
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.mode_specs import RegularMode, ReverseMode

from .config import LEARN_BUDGET, LEARN_REFUSED, LOG_FIELD, MAX_HELLO
from .policy import address_problem, host_problem, matching_entries, resolve
from .wire import AwaitClient, CloseClient, deny_http, fail_closed, hello_problem, json_response


class ProxyDoor:
    """A part of the addon (fila_gateway.Gateway): its methods use the addon's state."""

    # -- door "proxy": CONNECT

    async def _check_destination(self, host: str, port: int) -> tuple[str | None, str | None, bool]:
        """(reason it is refused, None, whether it was asked to be learned) or (None, the checked
        address to connect to, whether it is learned: no entry lists it and the config's `learn`
        let it through). Learning skips the allowlist lookup only: every other check below is the
        one a listed name gets. A name to learn is counted against max_requests before it is
        looked up, whatever comes of it: past the budget no lookup is made (the gateway's resolver
        is no free channel out for names that do not resolve or are refused)."""
        assert self.config is not None
        if problem := host_problem(host):
            return problem, None, False
        learned = False
        if not matching_entries(self.config["allow"], host, port):
            learn = self.config.get("learn")
            if learn is None or port not in learn["ports"]:
                return "not in allowlist", None, False
            learned = True
            limit = self.config["budget"]["max_requests"]
            if limit is not None and self.requests >= limit:
                return LEARN_BUDGET, None, True
            self.requests += 1
        try:
            addrs = await resolve(host + ".", port)  # absolute: no resolv.conf search domain
        except OSError as e:
            return f"does not resolve ({e.strerror or e})", None, learned
        if not addrs:
            return "does not resolve", None, learned
        for a in addrs:
            if problem := address_problem(a, self.config["allow_private"], self.config["host_addrs"]):
                return problem, None, learned
        return None, addrs[0], learned

    def _refuse_destination(self, flow: http.HTTPFlow, reason: str, learning: bool) -> None:
        """The refusal of `_check_destination`; for a name asked to be learned the engine reads a
        generic reason (LEARN_REFUSED), the log line keeps the detail."""
        if reason == LEARN_BUDGET:
            flow.metadata["fila_budget"] = "max_requests"
            return self.refuse(flow, 429, reason, budget="max_requests")
        if learning:
            flow.response = json_response(403, LEARN_REFUSED)
            return self.record(flow, allowed=False, reason=reason, status=403)
        return self.refuse(flow, 403, reason)

    @fail_closed(deny_http)
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        host = flow.request.host.lower().rstrip(".")
        port = flow.request.port
        flow.metadata.update(fila_door="proxy", fila_host=host, fila_port=port)
        if self.config is None:
            return self.refuse(flow, 503, "gateway has no config")
        if not isinstance(flow.client_conn.proxy_mode, RegularMode):
            return self.refuse(flow, 405, "CONNECT only on the proxy port")
        entries = matching_entries(self.config["allow"], host, port)
        if entries and all(e["methods"] is not None for e in entries):
            # Inside a tunnel the gateway sees no method (and no Host header): a method-limited
            # entry is reachable by plain HTTP only.
            return self.refuse(flow, 405, "method-limited entry: plain HTTP only, no CONNECT")
        reason, addr, learned = await self._check_destination(host, port)
        if reason:
            return self._refuse_destination(flow, reason, learned)
        # Pin: the tunnel opens to the address just checked, not to a second lookup of the name.
        # The client's TLS (and its SNI) passes through untouched.
        flow.request.data.host = addr
        self.tunnels[flow.client_conn.id] = {
            "id": flow.id,
            "host": host,
            "port": port,
            "in": 0,
            "out": 0,
            "learned": learned,
        }
        # Logged now (then again when it ends, same id): a gateway stopped while the tunnel is
        # open leaves a trace of it.
        self.in_flight += 1
        self.write(
            id=flow.id, door="proxy", method="CONNECT", host=host, port=port, allowed=True,
            reason="in flight", status=None, learned=learned,
        )  # fmt: skip

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        # After a CONNECT on the proxy port: once the first client bytes are a clean ClientHello for
        # the CONNECT host, relay raw bytes (no TLS interception). Anything else closes the tunnel.
        # (entrypoint.sh also sets allow_hosts so that mitmproxy's own choice is a raw relay too.)
        c = nextlayer.context
        if isinstance(c.client.proxy_mode, ReverseMode) and not any(
            isinstance(x, layers.HttpLayer) for x in c.layers
        ):
            # The route port speaks plain HTTP/1 only: TLS there would be terminated with
            # mitmproxy's own CA and bring HTTP/2, whose pseudo-headers are copied unchecked into
            # the upstream's HTTP/1 request. A client whose first bytes are a TLS handshake is closed.
            if nextlayer.data_client()[:1] == b"\x16" or isinstance(nextlayer.layer, layers.ClientTLSLayer):
                nextlayer.layer = CloseClient(c)
                self.write(door="route", reason="TLS on the route port (plain HTTP only)", status=None)
            return
        if not (
            isinstance(c.client.proxy_mode, RegularMode)
            and any(isinstance(x, layers.HttpLayer) for x in c.layers)
            and c.client.id in self.tunnels
        ):
            return
        data = nextlayer.data_client()
        chosen = self._tunnel_layer(c, data) if data else None
        # No decision yet (nothing from the client, or half a ClientHello): a layer of ours waits
        # for the client's bytes, keeping whatever the server sends first (a server that speaks
        # first gets nothing to the client before the check). Leaving the choice open would let
        # mitmproxy's own (a raw relay) take it at the server's first bytes.
        nextlayer.layer = chosen or AwaitClient(c, functools.partial(self._tunnel_layer, c))

    def _tunnel_layer(self, c: Any, data: bytes) -> layer.Layer | None:
        """The layer of a tunnel whose client sent `data` first: a raw relay, a close, or None
        while the ClientHello is incomplete."""
        # Fail closed: a tunnel carries a TLS handshake whose server name is the CONNECT host, and
        # nothing the gateway cannot read (an odd record version, an empty record first, plain HTTP
        # with another Host: the upstream would serve what the allowlist never named).
        if c.client.id not in self.tunnels:
            return CloseClient(c)
        problem = hello_problem(data)
        hello = None
        if problem is None:
            try:
                hello = parse_client_hello(data)
            except ValueError as e:
                problem = f"unreadable ClientHello ({e})"
            if hello is None and problem is None:
                if len(data) <= MAX_HELLO:
                    return None  # the ClientHello is incomplete: decided when more arrives
                problem = "ClientHello too large"
        sni = (hello.sni or "").lower().rstrip(".") if hello else ""
        host = self.tunnels[c.client.id]["host"]
        if problem is None and not sni:
            # A TLS client for a named host always names it: without a name, a shared front end
            # (a CDN) serves its default site, which nobody listed.
            problem = "tls ClientHello without a server name"
        elif problem is None and sni != host:
            # The TLS server name is what a shared front end (a CDN) routes by: a tunnel to a
            # listed name must not carry a handshake for another one (domain fronting).
            problem = f"tls server name {sni[:LOG_FIELD]} is not the CONNECT host"
        if problem is not None:
            t = self.tunnels.pop(c.client.id)
            if not problem.startswith("tls "):
                problem = f"tunnel closed: {problem}"
            self.in_flight -= 1
            self.write(
                id=t["id"], door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=False,
                reason=problem, status=None,
            )  # fmt: skip
            return CloseClient(c)
        return layers.TCPLayer(c)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        t = self.tunnels.get(flow.client_conn.id)
        msg = flow.messages[-1]
        if t is not None:
            t["out" if msg.from_client else "in"] += len(msg.content)
        flow.messages.clear()  # counted; a long tunnel must not keep every byte it carried

    def _tunnel_done(self, flow: tcp.TCPFlow, reason: str | None, status: int) -> None:
        t = self.tunnels.pop(flow.client_conn.id, None)
        if t is not None:
            self.in_flight -= 1
            self.write(
                id=t["id"], door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                reason=reason, status=status, bytes_in=t["in"], bytes_out=t["out"], learned=t["learned"],
            )  # fmt: skip

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        # The checked address did not accept the connection (mitmproxy answers 502).
        t = self.tunnels.pop(flow.client_conn.id, None)
        if t is not None and flow.response is not None:
            msg = flow.response.get_text(strict=False) or ""
            self.in_flight -= 1
            self.write(
                id=t["id"], door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                reason=f"upstream: {msg[:200]}", status=flow.response.status_code, learned=t["learned"],
            )  # fmt: skip

    def client_disconnected(self, client: Any) -> None:
        self.route_names.pop(client.id, None)
        # A tunnel the client closed before sending a byte (no TCP flow was ever made for it).
        t = self.tunnels.pop(client.id, None)
        if t is not None:
            self.in_flight -= 1
            self.write(
                id=t["id"], door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                status=200, bytes_in=t["in"], bytes_out=t["out"], learned=t["learned"],
            )  # fmt: skip

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self._tunnel_done(flow, None, 200)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self._tunnel_done(flow, f"upstream: {flow.error.msg if flow.error else 'error'}", 502)

    async def _proxy_request(self, flow: http.HTTPFlow) -> None:
        assert self.config is not None
        req = flow.request
        host, port = req.host.lower().rstrip("."), req.port
        flow.metadata.update(fila_door="proxy", fila_host=host, fila_port=port, fila_path=req.path)
        # The Host header must name the URL's host: a shared upstream (a CDN) would otherwise serve
        # a name nobody listed from a listed name's address.
        hh = req.host_header
        if hh is not None:
            try:
                hh_host, _ = url.parse_authority(hh, check=False)
            except ValueError:
                hh_host = hh
            if hh_host.lower().rstrip(".") != host:
                return self.refuse(flow, 403, "host header differs from the URL")
        entries = matching_entries(self.config["allow"], host, port)
        methods = [e["methods"] for e in entries]
        if entries and None not in methods and req.method not in {x for m in methods for x in m}:
            return self.refuse(flow, 405, "method not allowed")
        reason, addr, learned = await self._check_destination(host, port)
        if reason:
            return self._refuse_destination(flow, reason, learned)
        req.data.host = addr  # pinned, as for CONNECT; the Host header keeps the name
        flow.metadata["fila_meter"] = None
        flow.metadata["fila_learned"] = learned
        # Logged now (then again when it ends, same id): a gateway stopped mid-request leaves a
        # trace of it.
        self.in_flight += 1
        flow.metadata["fila_in_flight"] = True
        self.write(
            id=flow.id, door="proxy", method=req.method, host=host, port=port, path=req.path[:LOG_FIELD],
            allowed=True, reason="in flight", status=None, learned=learned,
        )  # fmt: skip
