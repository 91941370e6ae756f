"""Door "route" (the model routes on 8080): the route's real key added, the budget enforced before
forwarding, usage metered and the key scrubbed from the answer (`RouteDoor`, a part of the addon).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from mitmproxy import http

from .config import CREDENTIAL_HEADERS, CREDENTIAL_QUERY, LOG_FIELD, METERED, OVERRIDE_HEADERS
from .meter import Meter, Refusal
from .policy import address_problem, is_ip, resolve
from .record import escaped
from .scrub import SseScrubber
from .wire import deny_response, fail_closed, guarded, m_ok, unsafe_request

ESCAPED_SLASH = re.compile("%2[fF]")


class RouteDoor:
    """A part of the addon (fila_gateway.Gateway): its methods use the addon's state."""

    # -- door "route"

    async def _route_request(self, flow: http.HTTPFlow) -> None:
        assert self.config is not None
        req = flow.request
        path = req.path.split("?", 1)[0]
        parts = path.split("/", 2)  # "/anthropic/v1/messages" -> "", "anthropic", "v1/messages"
        name = parts[1] if len(parts) > 1 else ""
        rest = "/" + parts[2] if len(parts) > 2 else "/"
        flow.metadata.update(fila_door="route", fila_route=None, fila_path=rest)
        route = self.config["routes"].get(name)
        if route is None:
            # A name the engine made up (`v1`, `anthropic@host:80`, `a\\..\\b`) is a denied
            # request, never a route of the totals: it is logged as the path asked for.
            flow.metadata.update(fila_host=None, fila_port=None, fila_path=escaped(path))
            return self.refuse(flow, 404, "unknown route")
        flow.metadata.update(fila_route=name, fila_host=route["host"], fila_port=route["port"])
        if problem := unsafe_request(req):
            # Whatever reaches the upstream's HTTP/1 head must be what was checked here: no CR or
            # LF (a second request, another path, the real key with it), no byte parsed otherwise.
            return self.refuse(flow, 400, problem)
        decoded = ESCAPED_SLASH.sub("/", rest)
        if any(seg in (".", "..") for seg in decoded.split("/")) or any(c in decoded for c in "%\\;"):
            # Encoded dots, backslashes and `;` parameters: each server normalises them its own
            # way, so a path that matched a rule here could be another one there. `%2F` alone is
            # let through (npm's scoped names); only a rule's `**` matches it, and no dot segment
            # may appear once it is read as a slash.
            return self.refuse(flow, 400, "path with dot segments, %-escapes, \\ or ;")
        if req.headers.get("upgrade"):
            # A websocket (or h2c) upgrade would carry model traffic the meter never sees.
            return self.refuse(flow, 403, "protocol upgrade on a route")
        upath = route["base_path"] + rest
        if not any(req.method == m and rx.match(upath) for m, rx in route["paths"]):
            return self.refuse(flow, 403, "path not allowed on this route")
        if req.method in ("GET", "HEAD") and (
            req.headers.get("transfer-encoding") or req.headers.get("content-length", "0").strip() != "0"
        ):
            # A rule allows a method and a path; a body on a read is a request the rule never
            # named (a search, a query language some servers read from a GET).
            return self.refuse(flow, 400, f"a body on {req.method}")
        addr, reason = await self._route_address(route)
        if addr is None:
            return self.refuse(flow, 502 if reason.startswith("does not resolve") else 403, reason)
        metered = bool(METERED.search(upath))
        flow.metadata["fila_metered"] = metered
        budget = self.config["budget"]
        if metered and budget["max_tokens"] is not None:
            # One metered call at a time under a token budget: the next is checked against the
            # usage of the one before it, not sent while that one's tokens are still unknown.
            if self._slot is None:
                self._slot = asyncio.Lock()
            await self._slot.acquire()
            flow.metadata["fila_slot"] = True
        for key, used in (("max_requests", self.requests), ("max_tokens", self.tokens)):
            limit = budget[key]
            if limit is not None and used >= limit:
                flow.metadata["fila_budget"] = key
                return self.refuse(flow, 429, f"budget {key}", budget=key, limit=limit, used=used)
        self.requests += 1
        for h in (*CREDENTIAL_HEADERS, *OVERRIDE_HEADERS, route["header"]):
            req.headers.pop(h, None)
        for q in CREDENTIAL_QUERY:
            if q in req.query:
                del req.query[q]
        query = req.path.split("?", 1)[1] if "?" in req.path else ""
        req.scheme = route["scheme"]
        # Pinned: the connection opens to the address just checked, never to a second lookup of
        # the name; the Host header and the TLS server name stay the upstream's name.
        req.host = addr
        req.port = route["port"]
        self.route_names.setdefault(flow.client_conn.id, {})[(addr, route["port"])] = route["host"]
        req.path = upath + (f"?{query}" if query else "")
        req.host_header = route["host"] if route["port"] in (80, 443) else f"{route['host']}:{route['port']}"
        req.headers[route["header"]] = route["value"]
        # Usage is read from plain bodies; a compressed one would hide it.
        req.headers["accept-encoding"] = "identity"
        flow.metadata["fila_chat"] = req.method == "POST" and upath.endswith("/chat/completions")
        # Logged now (then again when it ends, same id): a gateway killed mid-call leaves a trace.
        self.in_flight += 1
        flow.metadata["fila_in_flight"] = True
        self.write(
            id=flow.id, door="route", method=req.method, host=route["host"], port=route["port"],
            route=name, path=rest[:LOG_FIELD], allowed=True, reason="in flight", status=None,
        )  # fmt: skip
        self._summarize(force=True)

    async def _route_address(self, route: dict[str, Any]) -> tuple[str | None, str]:
        """(the address to connect to, "") or (None, why not): the upstream's name resolved here
        and every address checked as the proxy door checks a listed name's (private outside
        allow_private, loopback, link-local, the host's own: a route's name that resolves, or is
        rebound, there is refused like any other)."""
        assert self.config is not None
        host, port = route["host"], route["port"]
        try:
            addrs = [host] if is_ip(host) else await resolve(host + ".", port)
        except OSError as e:
            return None, f"does not resolve ({e.strerror or e})"
        if not addrs:
            return None, "does not resolve"
        for a in addrs:
            if problem := address_problem(a, self.config["allow_private"], self.config["host_addrs"]):
                return None, f"route upstream {host}: {problem}"
        return addrs[0], ""

    def server_connect(self, data: Any) -> None:
        """Every upstream connection goes to an address a door checked: a name here would be
        looked up by mitmproxy itself, unchecked, and is refused. A route's connection to its
        pinned address is given the upstream's name as its TLS server name (and so the name its
        certificate must carry), never the address."""
        server = data.server
        host, port = server.address
        if not is_ip(host):
            server.error = f"unpinned upstream {host}: refused"
            return
        name = self.route_names.get(data.client.id, {}).get((host, port))
        if name is not None and server.sni is not None:
            server.sni = name

    @fail_closed(deny_response)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("fila_logged") or flow.response is None:
            return
        resp = flow.response
        route = flow.metadata.get("fila_door") == "route"
        if route and resp.status_code < 200:
            # 101 Switching Protocols would make the connection a raw pipe that no scrubber and no
            # meter sees. Any other 1xx (100 Continue, 103 Early Hints) mitmproxy takes for the
            # final answer and drops the one after it, so the engine would wait forever. Either
            # way the answer is not sent and the engine's connection is closed.
            flow.kill()
            what = "no protocol switch" if resp.status_code == 101 else "no interim answer"
            reason = f"route upstream answered {resp.status_code} ({what} on a route)"
            return self.record(flow, allowed=False, reason=reason, status=None)
        meter = Meter(resp.headers.get("content-type", ""), usage=route and m_ok(flow))
        flow.metadata["fila_meter"] = meter
        if not route:
            resp.stream = meter  # streamed on as it arrives; the meter only watches
            return
        # The upstream holds the credential the gateway added: whatever it echoes (a debugging
        # endpoint, an error quoting the request) is replaced before the engine sees it.
        counts: dict[str, int] = flow.metadata.setdefault("fila_scrubbed", {})
        resp.reason = self.needles.scrub_text(resp.reason, "status", counts)
        fields = tuple(
            (self.needles.scrub(k, "header", counts), self.needles.scrub(v, "header", counts))
            for k, v in resp.headers.fields
        )
        if fields != resp.headers.fields:
            resp.headers.fields = fields
        coding = ",".join(resp.headers.get_all("content-encoding")).replace(" ", "").lower()
        transfer = ",".join(resp.headers.get_all("transfer-encoding")).replace(" ", "").lower()
        if coding not in ("", "identity") or transfer not in ("", "chunked", "identity"):
            # The gateway asked for identity: a compressed body could carry the key unseen.
            refusal = Refusal(meter, f"route upstream sent a compressed body ({coding or transfer})")
            flow.metadata["fila_refusal"] = refusal
            counts["refused:compressed"] = counts.get("refused:compressed", 0) + 1
            resp.status_code, resp.reason = 502, "Bad Gateway"
            resp.headers = http.Headers(
                content_type="application/json", content_length=str(len(refusal.body))
            )
            resp.stream = guarded(refusal)
            return
        body = SseScrubber(self.needles, counts)
        resp.stream = guarded(lambda chunk: body(meter(chunk)))  # the meter reads what the upstream sent

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("fila_logged") or flow.response is None:
            return
        resp = flow.response
        reason = None
        if flow.metadata.get("fila_door") == "route":
            counts: dict[str, int] = flow.metadata.setdefault("fila_scrubbed", {})
            if resp.trailers:
                resp.trailers.fields = tuple(
                    (self.needles.scrub(k, "trailer", counts), self.needles.scrub(v, "trailer", counts))
                    for k, v in resp.trailers.fields
                )
            refusal: Refusal | None = flow.metadata.get("fila_refusal")
            if refusal is not None:
                reason = refusal.reason
                if not refusal.sent:  # a body-less answer: the refusal is its body
                    resp.content = refusal.body
                    refusal.sent = True
        self.record(flow, allowed=True, reason=reason, status=resp.status_code)
