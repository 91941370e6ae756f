"""fila's egress gateway: a mitmproxy addon that is the policy, the log and the meter.

mitmproxy does all the HTTP and TLS work. This addon decides, per request, whether it may pass:

- door "proxy" (forward proxy, regular mode on 3128): CONNECT only to a listed host:port without a
  method list, tunnelled raw (never intercepted: the engine trusts no gateway CA) once its first
  bytes are a clean TLS ClientHello for that host; plain-HTTP absolute-URL requests with the same
  checks plus the entry's method list. The name is resolved here, every address must be
  global (or inside `allow_private`), and the connection is pinned to the checked address so that a
  second lookup (DNS rebinding) cannot change where it goes.
- door "route" (reverse mode on 8080, plain HTTP/1 only: a client starting TLS is closed, HTTP/2 is
  off): `/<route>/<rest>` goes to the route's upstream with the engine's credential headers dropped
  and the real one (from the secrets directory) added, for the route's `paths` only (no upgrades, no
  escapes, nothing but printable ASCII in the target and the header values); usage is read from
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
import base64
import contextlib
import functools
import ipaddress
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import ctx, dns, http, tcp
from mitmproxy.connection import ConnectionState
from mitmproxy.net.dns import response_codes
from mitmproxy.net.dns import types as dns_types
from mitmproxy.net.http import http1, status_codes, url
from mitmproxy.proxy import commands, events, layer, layers, mode_servers
from mitmproxy.proxy.layers.http import ResponseProtocolError, _http1
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.mode_specs import RegularMode, ReverseMode

CONFIG_PATH = Path(os.environ.get("FILA_GATEWAY_CONFIG", "/etc/fila-gateway/config.json"))
SECRETS_DIR = Path(os.environ.get("FILA_GATEWAY_SECRETS", "/run/fila-gateway/secrets"))
LOG_DIR = Path(os.environ.get("FILA_GATEWAY_LOG_DIR", "/var/log/fila-gateway"))
PROXY_PORT = int(os.environ.get("FILA_GATEWAY_PROXY_PORT", "3128"))
ROUTE_PORT = int(os.environ.get("FILA_GATEWAY_ROUTE_PORT", "8080"))
SINK_PORT = int(os.environ.get("FILA_GATEWAY_SINK_PORT", "3127"))  # entrypoint.sh's reverse target
DNS_PORT = int(os.environ.get("FILA_GATEWAY_DNS_PORT", "53"))
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
# A spare (FILA_GATEWAY_WAIT=1): started before any job, it listens and refuses everything until
# the host writes its config, looked for every CONFIG_POLL_S.
WAIT = os.environ.get("FILA_GATEWAY_WAIT") == "1"


def _inherited(spec: str) -> dict[str, list[int]]:
    """launch.py's sockets: `tcp:3128=3,tcp:3128=4,udp:53=5` -> {"tcp:3128": [3, 4], "udp:53": [5]}."""
    out: dict[str, list[int]] = {}
    for item in filter(None, spec.split(",")):
        name, _, fd = item.rpartition("=")
        out.setdefault(name, []).append(int(fd))
    return out


# The doors' sockets bound by launch.py before mitmdump started (none when mitmdump is run
# directly: mitmproxy then binds its own listeners, and the DNS door binds here).
SOCKETS = _inherited(os.environ.get("FILA_GATEWAY_SOCKETS", ""))
CONFIG_POLL_S = 0.01

MAX_HEADER_BYTES = 32 * 1024  # mitmproxy reads headers without a limit; refuse what no API needs
MAX_BODY_SCAN = 8 * 1024 * 1024  # a non-streamed JSON body kept for reading its usage
MAX_SSE_LINE = 1024 * 1024
MAX_HEAD_READ = 64 * 1024  # a request head still without its blank line past this: 431, connection closed
MAX_HELLO = 64 * 1024  # a TLS ClientHello still incomplete past this: the tunnel is closed
# egress.jsonl stops growing here (fila reads 8 MiB); summary.json keeps the totals. (Settable for tests.)
LOG_CAP = int(os.environ.get("FILA_GATEWAY_LOG_CAP", str(4 * 1024 * 1024)))
LOG_FIELD = 256  # host and path in a log line are cut to this many characters
TLS_VERSIONS = (b"\x03\x01", b"\x03\x02", b"\x03\x03")  # record versions a ClientHello is sent with

# What each known route may ask its upstream (METHOD and upstream path; `*` is one path segment of
# [A-Za-z0-9._-]): the model calls the engines make, not the upstream's whole API (files, batches,
# fine-tuning: unmetered cost, other work's data). A route's `paths` in the config replaces these.
DEFAULT_PATHS = {
    "anthropic": [
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "GET /v1/models",
        "GET /v1/models/*",
    ],
    "openai": ["POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models", "GET /v1/models/*"],
    "gemini": [
        "POST /v1beta/models/*:generateContent",
        "POST /v1beta/models/*:streamGenerateContent",
        "POST /v1beta/models/*:countTokens",
        "GET /v1beta/models",
        "GET /v1beta/models/*",
    ],
}
_PATH_RULE = re.compile(r"^([A-Z]{1,16}) (/[A-Za-z0-9._:/*-]*)$")
# The model calls whose responses carry usage: only these are metered, serialised under a token
# budget, and read for usage (any other body is not a usage report, whatever it says).
METERED = re.compile(r"(/messages|/chat/completions|/responses|:generateContent|:streamGenerateContent)$")

# Headers that carry a credential on some model API: whatever the engine sends is dropped.
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization")
CREDENTIAL_QUERY = ("key",)

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
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$"
)
# Every form inet_aton() accepts as an address: 127.1, 2130706433, 0x7f000001, 0177.0.0.1.
_NUMERIC_HOST = re.compile(r"^((0x[0-9a-f]*)|[0-9]+)(\.((0x[0-9a-f]*)|[0-9]+))*$")
_ROUTE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
LEARN_BUDGET = "learning budget max_requests spent"
# What the engine reads when a name it asked to learn is refused: the reason (which address the
# name resolved to, whether it resolved) is the log's, not the engine's (no internal DNS map).
LEARN_REFUSED = "destination refused"

logger = logging.getLogger("fila_gateway")


class ConfigError(Exception):
    """The gateway's config or a secret it names is unusable: the gateway must not start."""


# ---------------------------------------------------------------- config


def _allow_entry(raw: Any, i: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"allow[{i}] must be an object")
    host, port, methods = raw.get("host"), raw.get("port"), raw.get("methods")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"allow[{i}].host must be a non-empty string")
    host = host.lower().rstrip(".")
    bare = host[2:] if host.startswith("*.") else host
    if not _HOSTNAME.match(bare) or _NUMERIC_HOST.match(bare) or _is_ip(bare):
        raise ConfigError(f"allow[{i}].host {host!r} is not a DNS name")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ConfigError(f"allow[{i}].port must be an integer 1-65535")
    if methods is not None and (
        not isinstance(methods, list) or not all(isinstance(m, str) and m for m in methods)
    ):
        raise ConfigError(f"allow[{i}].methods must be null or a list of method names")
    return {"host": host, "port": port, "methods": None if methods is None else [m.upper() for m in methods]}


def _route(name: str, raw: Any) -> dict[str, Any]:
    if not _ROUTE_NAME.match(name):
        raise ConfigError(f"routes: {name!r} is not a route name (a-z, 0-9, -, _)")
    if not isinstance(raw, dict):
        raise ConfigError(f"routes.{name} must be an object")
    up = raw.get("upstream")
    parts = urlsplit(up) if isinstance(up, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"routes.{name}.upstream must be an http(s) URL")
    header, fmt, secret = raw.get("header"), raw.get("format", "{key}"), raw.get("secret")
    if not isinstance(header, str) or not re.fullmatch(r"[A-Za-z0-9-]+", header):
        raise ConfigError(f"routes.{name}.header must be a header name")
    if not isinstance(fmt, str) or "{key}" not in fmt:
        raise ConfigError(f"routes.{name}.format must contain {{key}}")
    paths = raw.get("paths")
    if paths is None:
        paths = DEFAULT_PATHS.get(name)
    if not isinstance(paths, list) or not paths:
        raise ConfigError(f'routes.{name}.paths must list "METHOD /path" rules (no default for {name!r})')
    rules = []
    for rule in paths:
        m = _PATH_RULE.match(rule) if isinstance(rule, str) else None
        if m is None or any(seg in (".", "..") for seg in m[2].split("/")):
            raise ConfigError(f'routes.{name}.paths: {rule!r} is not "METHOD /path" (* is one segment)')
        body = "[A-Za-z0-9._-]+".join(re.escape(x) for x in m[2].split("*"))
        rules.append((m[1], re.compile(f"^{body}$")))
    if not isinstance(secret, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", secret) or secret.startswith("."):
        raise ConfigError(f"routes.{name}.secret must name a file in {SECRETS_DIR}")
    path = SECRETS_DIR / secret
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"routes.{name}: cannot read the secret {path}: {e.strerror}") from e
    if not key or "\n" in key or "\r" in key:
        raise ConfigError(f"routes.{name}: the secret {path} must hold one line")
    return {
        "scheme": parts.scheme,
        "host": parts.hostname,
        "port": parts.port or (443 if parts.scheme == "https" else 80),
        "base_path": parts.path.rstrip("/"),
        "header": header.lower(),
        "value": fmt.replace("{key}", key),
        "key": key,
        "paths": rules,
    }


def _new_totals() -> dict[str, Any]:
    return {"allowed": 0, "denied": 0, "routes": {}, "budget_exhausted": None, "suppressed": {}}


def _mark(path: Path) -> None:
    """A marker file for the host (`listening`, `ready`), written whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(_now() + "\n")
    tmp.replace(path)


def load_config(path: Path = CONFIG_PATH) -> dict[str, Any]:
    """The parsed, checked config with each route's credential read in. Raises ConfigError."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the gateway config {path}: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"the gateway config {path} is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"the gateway config {path} must be a JSON object")
    allow = raw.get("allow") or []
    if not isinstance(allow, list):
        raise ConfigError("allow must be a list")
    try:
        private = [ipaddress.ip_network(c, strict=False) for c in raw.get("allow_private") or []]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"allow_private: {e}") from e
    routes = raw.get("routes") or {}
    if not isinstance(routes, dict):
        raise ConfigError("routes must be an object")
    budget = raw.get("budget") or {}
    for k in ("max_requests", "max_tokens"):
        v = budget.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"budget.{k} must be null or a non-negative integer")
    try:
        clients = None if raw.get("clients") is None else [ipaddress.ip_network(c) for c in raw["clients"]]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"clients: {e}") from e
    try:
        host_addrs = {ipaddress.ip_address(a) for a in raw.get("host_addresses") or []}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"host_addresses: {e}") from e
    learn = raw.get("learn")
    if learn is not None:
        ports = learn.get("ports") if isinstance(learn, dict) else None
        if (
            not isinstance(ports, list)
            or not ports
            or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
        ):
            raise ConfigError('learn must be null or {"ports": [port, ...]}')
        if budget.get("max_requests") is None:
            raise ConfigError("learn needs budget.max_requests (learning is never unbounded)")
        learn = {"ports": sorted(set(ports))}
    ca = raw.get("upstream_ca")
    if ca is not None and not (isinstance(ca, str) and Path(ca).is_file()):
        raise ConfigError(f"upstream_ca {ca!r} is not a readable file in the gateway")
    return {
        "job": str(raw.get("job") or ""),
        "allow": [_allow_entry(e, i) for i, e in enumerate(allow)],
        "allow_private": private,
        "host_addrs": host_addrs,
        "routes": {n: _route(n, r) for n, r in routes.items()},
        "budget": {"max_requests": budget.get("max_requests"), "max_tokens": budget.get("max_tokens")},
        "upstream_ca": ca,
        "clients": clients,
        "learn": learn,
    }


# ---------------------------------------------------------------- host checks


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_problem(host: str) -> str | None:
    """Why a host name may not be asked for at all, before any allowlist lookup."""
    if _is_ip(host) or _NUMERIC_HOST.match(host):
        return "ip literal"
    if not _HOSTNAME.match(host):
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


# ---------------------------------------------------------------- usage metering


def _usage_of(obj: Any) -> dict[str, Any] | None:
    """The usage object in one API response body or stream event, any of the supported APIs."""
    if not isinstance(obj, dict):
        return None
    typ = obj.get("type")
    if typ == "message_start" and isinstance(obj.get("message"), dict):
        return obj["message"].get("usage")  # Anthropic stream start: input tokens
    if isinstance(typ, str) and typ.startswith("response.") and isinstance(obj.get("response"), dict):
        return obj["response"].get("usage")  # OpenAI Responses: response.completed
    if isinstance(obj.get("usageMetadata"), dict):
        return obj["usageMetadata"]  # Gemini
    if isinstance(obj.get("usage"), dict):
        return obj["usage"]  # Anthropic body / message_delta, OpenAI body / final chunk
    return None


def normalize_usage(raw: dict[str, Any]) -> dict[str, int] | None:
    """{"input_tokens", "output_tokens"} from the fields each API uses. Anthropic's cache reads and
    writes count as input (they are billed as input)."""

    def n(*keys: str) -> int:
        # A negative or non-integer count is no usage report (it would credit the budget back).
        return sum(v for k in keys if isinstance(v := raw.get(k), int) and not isinstance(v, bool) and v >= 0)

    if not raw:
        return None
    return {
        "input_tokens": n(
            "input_tokens", "prompt_tokens", "promptTokenCount",
            "cache_creation_input_tokens", "cache_read_input_tokens",
        ),
        "output_tokens": n(
            "output_tokens", "completion_tokens", "candidatesTokenCount", "thoughtsTokenCount"
        ),
    }  # fmt: skip


class Meter:
    """Watches one response go by: counts bytes and collects usage, streamed or not."""

    def __init__(self, content_type: str, *, usage: bool = True) -> None:
        ctype = content_type.lower().split(";", 1)[0].strip()
        self.sse = usage and ctype == "text/event-stream"
        self.bytes = 0
        self.raw_usage: dict[str, Any] = {}
        self._pending = b""
        # Only a route's JSON reply is kept (bounded) to read its usage; proxied bodies are counted.
        # Usage is read only from a JSON, JSON lines or SSE reply of a model call (the caller's `usage`).
        kept = usage and ctype in ("application/json", "application/x-ndjson", "application/jsonl")
        self._body: bytearray | None = bytearray() if kept else None
        self.overflow = False

    def __call__(self, chunk: bytes) -> bytes:
        # Called by mitmproxy for every chunk of a streamed response, and once with b"" at its end.
        self.bytes += len(chunk)
        if self.sse:
            self._pending += chunk
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                self._line(line)
            if len(self._pending) > MAX_SSE_LINE:
                self._pending = b""  # no API sends such a line; do not hold on to it
            if not chunk and self._pending:
                self._line(self._pending)
                self._pending = b""
        elif self._body is not None:
            if len(self._body) + len(chunk) > MAX_BODY_SCAN:
                self._body = None
                self.overflow = True
            else:
                self._body += chunk
        return chunk

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return
        with contextlib.suppress(ValueError):
            self._add(json.loads(line[5:].strip() or b"null"))

    def _add(self, obj: Any) -> None:
        usage = _usage_of(obj)
        if isinstance(usage, dict):
            self.raw_usage.update({k: v for k, v in usage.items() if v is not None})

    def usage(self) -> dict[str, int] | None:
        if self._body:
            # One JSON document, JSON lines, or a JSON array of chunks (Gemini's streamGenerateContent
            # without alt=sse): each value in turn, so the last usage report counts.
            with contextlib.suppress(UnicodeDecodeError):
                for _, _, value in _json_values(bytes(self._body).decode()):
                    self._add(value)
            self._body = None
        return normalize_usage(self.raw_usage)


# ---------------------------------------------------------------- credential scrubbing


SCRUB_MARKER = b"fila-scrubbed"
MAX_SSE_HOLD = 1024 * 1024  # bytes of complete SSE events held back for a key spread over several


HTML_ZEROS = 8  # leading zeros a character reference may have (`&#00000045;`)
# What may break a base64 text between two characters: CRLF, CR, LF or a space, as is or JSON-escaped.
_B64_BREAK = r"(?:\r\n|[\r\n ]|\\r\\n|\\[rn]|\\u0020)"


def _hex_class(n: int) -> str:
    """`%2d`, `%2D`: a byte's two hex digits, either case."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in f"{n:02x}")


class Needles:
    """Every form of the route credentials a response must not carry to the engine, as one regex:
    each character of a key literal, percent-encoded once or twice (`%2d`, `%252D`, either case),
    JSON-escaped (`\\u00xx`, `\\/`), a JS/Python escape (`\\x2d`, either case) or an HTML
    character reference (`&#45;`, `&#x2d;`, the `;` optional, up to HTML_ZEROS leading zeros), in any
    mixture; the key's hex (either case); and the key's base64 (standard and urlsafe) at each of the
    three alignments it can have inside a longer encoded text (the whole groups only: the odd bytes
    at its ends leak at most two characters), a line break (CRLF, LF or CR, as MIME wraps it) or a
    space, as is or JSON-escaped, allowed between any two of its characters. Matches are replaced by
    a marker of the same length, so a response's Content-Length stays true."""

    def __init__(self, keys: Iterable[str]) -> None:
        keys = sorted({k for k in keys if k}, key=len, reverse=True)
        self.b64: set[bytes] = set()
        self.hex: set[bytes] = set()
        alts: list[str] = []
        longest = 0
        for key in keys:
            parts = []
            for ch in key:
                n = ord(ch)
                forms = [re.escape(ch)]
                if n < 0x80:
                    forms += [
                        f"%(?:25)?{_hex_class(n)}",
                        f"\\\\u00{_hex_class(n)}",
                        f"\\\\x{_hex_class(n)}",
                        f"&#0{{0,{HTML_ZEROS}}}{n};?",
                        f"&#[xX]0{{0,{HTML_ZEROS}}}{_hex_class(n)};?",
                    ]
                    if ch in '/"\\':
                        forms.append(re.escape("\\" + ch))
                parts.append("(?:" + "|".join(forms) + ")")
            alts.append("".join(parts))
            raw = key.encode()
            longest = max(
                longest, (6 + HTML_ZEROS) * len(raw)
            )  # `&#x0..0hh;`: the longest form of one character
            self.hex.add(raw.hex().encode())
            alts.append("".join(_hex_class(b) for b in raw))
            for a in range(3):
                whole = raw[a:][: (len(raw) - a) // 3 * 3]
                if len(whole) >= 6:  # shorter would match ordinary text
                    for enc in (base64.b64encode(whole), base64.urlsafe_b64encode(whole)):
                        self.b64.add(enc)
                        longest = max(longest, 7 * len(enc))  # a break (6 escaped) after each character
        # A line break or a space (as is or JSON-escaped) may come between any two characters.
        brk = _B64_BREAK + "?"
        alts += [brk.join(re.escape(c) for c in b.decode()) for b in sorted(self.b64, key=len, reverse=True)]
        self.empty = not alts
        pattern = "|".join(alts) or "(?!)"
        self.rx = re.compile(pattern.encode())
        self.rx_text = re.compile(pattern)
        self.longest = longest
        self.starts = list(keys) + [b.decode() for b in self.b64]

    def starts_in(self, text: str, least: int) -> bool:
        """Whether `text` ends with the first `least` or more characters of a key or of one of
        its base64 forms (the rest of it may come next)."""
        for n in self.starts:
            for k in range(min(len(text), len(n) - 1), least - 1, -1):
                if text.endswith(n[:k]):
                    return True
        return False

    def kind(self, match: bytes | str) -> str:
        raw = match.encode() if isinstance(match, str) else match
        if re.sub(_B64_BREAK.encode(), b"", raw) in self.b64:
            return ":base64"
        if raw.lower() in self.hex:
            return ":hex"
        if b"\\" in raw:
            return ":json"
        if b"%" in raw:
            return ":url"
        if b"&#" in raw:
            return ":html"
        return ""

    def scrub(self, data: bytes, where: str, counts: dict[str, int]) -> bytes:
        """`data` with every match replaced, each counted in `counts` as where[:encoding]."""
        if self.empty or not data:
            return data

        def rep(m: re.Match[bytes]) -> bytes:
            kind = where + self.kind(m[0])
            counts[kind] = counts.get(kind, 0) + 1
            return _marker(len(m[0]))

        return self.rx.sub(rep, data)

    def scrub_text(self, text: str, where: str, counts: dict[str, int]) -> str:
        raw = text.encode("utf-8", "surrogateescape")
        out = self.scrub(raw, where, counts)
        return text if out is raw or out == raw else out.decode("utf-8", "surrogateescape")


def _marker(n: int) -> bytes:
    return (SCRUB_MARKER + b"*" * n)[:n] if n >= len(SCRUB_MARKER) else b"*" * n


class StreamScrubber:
    """A response body's bytes on their way to the engine, any content type: matches are replaced
    as the bytes pass; the last len(longest form) - 1 bytes are held back until the next chunk (a
    key split across chunks), and flushed at the end."""

    def __init__(self, needles: Needles, counts: dict[str, int]) -> None:
        self.needles = needles
        self.counts = counts
        self.hold = b""

    def __call__(self, chunk: bytes) -> bytes:
        buf = self.hold + chunk
        if not chunk:  # the end: nothing more can complete a match
            self.hold = b""
            return self.needles.scrub(buf, "body", self.counts)
        cut = max(0, len(buf) - (self.needles.longest - 1))
        for m in self.needles.rx.finditer(buf):
            if m.end() > cut:
                if m.start() < cut:
                    cut = m.end()  # a whole match across the cut: out with it, replaced
                break
        self.hold = buf[cut:]
        return self.needles.scrub(buf[:cut], "body", self.counts)


# The blank line that ends an event: two line ends in a row, each CRLF, LF or CR (a CRLF is one
# line end, never a CR and then an LF: the groups are atomic).
_SSE_END = re.compile(rb"(?>\r\n|\n|\r)(?>\r\n|\n|\r)")


class SseScrubber:
    """A route's answer, passed on event by event (never the whole body): any content type goes
    through it (an engine may read a stream whatever its Content-Type says), and a body that is no
    event stream is one event, scrubbed as bytes. Each complete event is scrubbed as bytes. An
    engine also joins strings of successive events (text deltas, tool argument pieces, a content
    block's start and its deltas, a candidate's parts): per field (its JSON path), per field name,
    and over all strings in order, the text so far is searched too, so a key spread over several
    strings is found, and its characters in events not yet sent are replaced. An event whose field ends with
    SPLIT_MIN or more characters of the start of a form of a key is held back until the next events
    show whether the key goes on (at the end of the stream it is sent): what may reach the engine
    before the rest of a split key is found is fewer than SPLIT_MIN of its first characters. An
    event still incomplete past MAX_SSE_LINE goes through the byte filter as it arrives, up to its
    end, and the events after it are read as events again; held events past MAX_SSE_HOLD bytes are
    sent (a key's first characters then reach the engine, never the rest of it)."""

    SPLIT_MIN = 8

    def __init__(self, needles: Needles, counts: dict[str, int]) -> None:
        self.needles = needles
        self.counts = counts
        self.raw = b""
        self.held: list[_SseEvent] = []
        self.sent: dict[tuple[Any, ...], str] = {}  # per running text: the end of what was passed on
        self.oversized: StreamScrubber | None = None  # the byte filter of an event past MAX_SSE_LINE
        self._tail = b""  # the last bytes of the oversized event so far

    def __call__(self, chunk: bytes) -> bytes:
        final = not chunk
        out = b""
        if self.oversized is not None:
            out += self._pass_oversized(chunk)
            if self.oversized is not None or final:
                return out
            chunk, self.raw = self.raw, b""  # what came after the oversized event's end
        self.raw += chunk
        ends = list(_SSE_END.finditer(self.raw))
        cut = len(self.raw) if final else (ends[-1].end() if ends else 0)
        block, self.raw = self.raw[:cut], self.raw[cut:]
        start = 0
        for m in _SSE_END.finditer(block):
            self.held.append(_SseEvent(self.needles.scrub(block[start : m.end()], "body", self.counts)))
            start = m.end()
        if start < len(block):
            self.held.append(_SseEvent(self.needles.scrub(block[start:], "body", self.counts)))
        wait = self._scan() and not final and sum(len(e.raw) for e in self.held) <= MAX_SSE_HOLD
        out += self._emit(not wait)
        if len(self.raw) > MAX_SSE_LINE:
            out += self._emit(True)
            self.oversized = StreamScrubber(self.needles, self.counts)
            self._tail = b""
            data, self.raw = self.raw, b""
            out += self._pass_oversized(data)
            if self.oversized is None and self.raw:
                rest, self.raw = self.raw, b""
                out += self(rest)
        return out

    def _pass_oversized(self, chunk: bytes) -> bytes:
        """The bytes of an oversized event through the byte filter up to its end (the end of the
        stream, or its blank line: what follows is left in self.raw, to be read as events)."""
        assert self.oversized is not None
        if not chunk:
            out = self.oversized(b"")
            self.oversized = None
            return out
        tail = self._tail  # a blank line split across chunks: the bytes just before count too
        self._tail = (tail + chunk)[-3:]
        end = next((m.end() for m in _SSE_END.finditer(tail + chunk) if m.end() > len(tail)), None)
        if end is None:
            return self.oversized(chunk)
        at = end - len(tail)
        out = self.oversized(chunk[:at]) + self.oversized(b"")
        self.oversized = None
        self.raw = chunk[at:]
        return out

    def _scan(self) -> bool:
        """Replace the keys found in the running texts across events; True when the held events
        must wait. Three kinds of running text, searched in turn (what one finds is gone from the
        next): each field by its JSON path, each field name wherever it is (`content_block.text`
        then `delta.text`, `parts[0].text` then `parts[1].text`), and all string values in order."""
        if self.needles.empty or not self.held:
            return False
        wait = False
        for group in (lambda p: ("path", p), _name_of, lambda p: ("all",)):
            fields: dict[Any, list[tuple[int, _SseEvent, int]]] = {}
            texts: dict[Any, list[str]] = {}
            for ev in self.held:
                for i, (path, s) in enumerate(ev.strings):
                    key = group(path)
                    parts = texts.setdefault(key, [self.sent.get(key, "")])
                    fields.setdefault(key, []).append((sum(map(len, parts)), ev, i))
                    parts.append(s)
            for key, parts in texts.items():
                text = "".join(parts)
                for m in self.needles.rx_text.finditer(text):
                    kind = "body:split" + self.needles.kind(m[0])
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                    for off, ev, i in fields[key]:
                        p, piece = ev.strings[i]
                        lo, hi = max(m.start(), off), min(m.end(), off + len(piece))
                        if lo < hi:
                            ev.strings[i] = (p, piece[: lo - off] + "*" * (hi - lo) + piece[hi - off :])
                            ev.changed = True
                    text = text[: m.start()] + "*" * len(m[0]) + text[m.end() :]
                wait = wait or self.needles.starts_in(text[-self.needles.longest :], self.SPLIT_MIN)
        return wait

    def _emit(self, go: bool) -> bytes:
        if not go:
            return b""
        out = []
        for ev in self.held:
            for path, s in ev.strings:
                for key in (("path", path), _name_of(path), ("all",)):
                    self.sent[key] = (self.sent.get(key, "") + s)[-self.needles.longest :]
            out.append(ev.bytes())
        self.held = []
        return b"".join(out)


class _SseEvent:
    """One event's bytes and the string values of its data (JSON), each with its path. A body that
    is no event stream (no `data:` line) is read as JSON values one after another: a whole JSON
    document, JSON lines (NDJSON), or the elements of a JSON array (Gemini's streamGenerateContent
    without alt=sse), so that its strings join the same running texts."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.changed = False
        self.obj: Any = None
        self.json = False
        self.strings: list[tuple[tuple[Any, ...], str]] = []
        self.values: list[tuple[int, int, Any, int]] | None = None  # (start, end, value, strings)
        data = [ln[5:].removeprefix(b" ") for ln in re.split(rb"\r\n|\n|\r", raw) if ln.startswith(b"data:")]
        if not data:
            self.values = []
            for start, end, value in _json_values(raw.decode("utf-8", "surrogateescape")):
                n = len(self.strings)
                _strings_of(value, (), self.strings)
                self.values.append((start, end, value, len(self.strings) - n))
            return
        text = b"\n".join(data).decode("utf-8", "surrogateescape")
        try:
            self.obj = json.loads(text)
            self.json = True
        except ValueError:
            self.obj = text
        _strings_of(self.obj, (), self.strings)

    def bytes(self) -> bytes:
        """The event with its replaced strings, exactly as long as it came (a declared
        Content-Length stays true): padded with spaces after the data, or, should the data come
        out longer, an empty string as the data."""
        if not self.changed:
            return self.raw
        if self.values is not None:
            return self._rebuild_values()
        obj = _with_strings(self.obj, iter(s for _, s in self.strings))
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")) if self.json else obj
        out = self._build(data, 0)
        if len(out) > len(self.raw):
            data = '""' if self.json else ""
            out = self._build(data, 0)
        return self._build(data, max(0, len(self.raw) - len(out)))

    def _rebuild_values(self) -> bytes:
        """The body with each JSON value that holds a replaced string written anew, padded with
        spaces to its length (or an empty string, padded, should it come out longer)."""
        assert self.values is not None
        text = self.raw.decode("utf-8", "surrogateescape")
        out, at, first = [], 0, 0
        for start, end, value, n in self.values:
            mine = [s for _, s in self.strings[first : first + n]]
            first += n
            if mine == [s for _, s in _strings_list(value)]:
                continue
            new = json.dumps(_with_strings(value, iter(mine)), ensure_ascii=False, separators=(",", ":"))
            size = len(text[start:end].encode("utf-8", "surrogateescape"))
            if len(new.encode("utf-8", "surrogateescape")) > size:
                new = '""'
            new += " " * (size - len(new.encode("utf-8", "surrogateescape")))
            out += [text[at:start], new]
            at = end
        out.append(text[at:])
        return "".join(out).encode("utf-8", "surrogateescape")

    def _build(self, data: str, pad: int) -> bytes:
        out, placed = [], False
        for ln in re.split(rb"\r\n|\n|\r", self.raw):
            if ln.startswith(b"data:"):
                if not placed:
                    out += [b"data: " + x.encode("utf-8", "surrogateescape") for x in data.split("\n")]
                    out[-1] += b" " * pad
                    placed = True
            else:
                out.append(ln)
        return b"\n".join(out)


def _strings_of(obj: Any, path: tuple[Any, ...], out: list[tuple[tuple[Any, ...], str]]) -> None:
    """The string values of a JSON document in order, each with its path (list indices kept:
    OpenAI's choices[0] and choices[1] are separate texts)."""
    if isinstance(obj, str):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _strings_of(v, (*path, k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _strings_of(v, (*path, i), out)


_JSON = json.JSONDecoder()
_BETWEEN_VALUES = re.compile(r"[\s\[\],]*")  # what separates JSON lines or a JSON array's elements


def _json_values(text: str) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) of the JSON values in `text` one after another, the elements of an
    array one by one; reading stops at the first thing that is not JSON."""
    at = 0
    while True:
        at = _BETWEEN_VALUES.match(text, at).end()  # type: ignore[union-attr]
        if at >= len(text):
            return
        try:
            value, end = _JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return
        yield at, end, value
        at = end


def _strings_list(obj: Any) -> list[tuple[tuple[Any, ...], str]]:
    out: list[tuple[tuple[Any, ...], str]] = []
    _strings_of(obj, (), out)
    return out


def _name_of(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The running text a field joins by its name: the last object key on its path."""
    return ("name", next((p for p in reversed(path) if isinstance(p, str)), None))


def _with_strings(obj: Any, it: Iterator[str]) -> Any:
    if isinstance(obj, str):
        return next(it)
    if isinstance(obj, dict):
        return {k: _with_strings(v, it) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_with_strings(v, it) for v in obj]
    return obj


class Refusal:
    """The body of a route response refused whole (a compressed one): the gateway's own error
    in its place, whatever the upstream sends (still counted by the meter)."""

    def __init__(self, meter: Meter, reason: str) -> None:
        self.meter = meter
        self.reason = reason
        self.body = json.dumps({"error": {"type": "fila_gateway", "message": reason}}).encode()
        self.sent = False

    def __call__(self, chunk: bytes) -> bytes:
        self.meter(chunk)
        if self.sent:
            return b""
        self.sent = True
        return self.body


# ---------------------------------------------------------------- the addon


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def m_ok(flow: http.HTTPFlow) -> bool:
    return bool(flow.metadata.get("fila_metered"))


def _json_response(status: int, reason: str, **extra: Any) -> http.Response:
    body = json.dumps({"error": {"type": "fila_gateway", "message": reason, **extra}}).encode()
    return http.Response.make(status, body, {"content-type": "application/json", "connection": "close"})


def _pieces(data: bytes) -> list[bytes]:
    """What a response's stream function returns: an empty bytes would go out as a chunk of its
    own, and an empty chunk ends a chunked body for the client; nothing to send is no chunk."""
    return [data] if data else []


def _guarded(fn: Callable[[bytes], bytes]) -> Callable[[bytes], list[bytes]]:
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


def _escaped(text: str) -> str:
    """Engine-chosen text for the log, cut to LOG_FIELD: anything but printable ASCII escaped."""
    text = text[: LOG_FIELD + 1]
    return "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1] for c in text)


_UNSAFE_TARGET = re.compile(rb"[^\x21-\x7e]")  # control characters, space, non-ASCII
_UNSAFE_VALUE = re.compile(rb"[^\x20-\x7e]")  # a header value may hold spaces
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _unsafe_request(req: http.Request) -> str | None:
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


def _header_bytes(req: http.Request) -> int:
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


def _deny_http(self: Gateway, flow: http.HTTPFlow, reason: str) -> None:
    if not flow.metadata.get("fila_logged"):
        flow.response = _json_response(500, reason)
        self.record(flow, allowed=False, reason=reason, status=500)


def _deny_response(self: Gateway, flow: http.HTTPFlow, reason: str) -> None:
    # Too late for an answer of the gateway's own (the upstream's body would be sent in it): the
    # flow is killed, and the engine's connection closed without a byte of the answer.
    flow.kill()
    self.record(flow, allowed=False, reason=reason, status=None)


def _deny_tcp(self: Gateway, flow: tcp.TCPFlow, reason: str) -> None:
    flow.kill()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        yield commands.SendData(self.conn, http1.assemble_response(_json_response(event.code, reason)))
        yield commands.CloseConnection(self.conn)
        return
    yield from _http1_server_send(self, event)


_http1.Http1Server.read_headers = _bounded_read_headers  # type: ignore[method-assign]
_http1.Http1Server.send = _own_error_answer  # type: ignore[method-assign]


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


class Gateway:
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
        self.totals: dict[str, Any] = _new_totals()
        self._summary_at = 0.0
        self.needles = Needles(())  # the route credentials, in every form a response must not carry
        self._waiting: asyncio.Task[None] | None = None  # the wait to serve (a spare's: for its config)
        self._prepared: asyncio.Future[bool] | None = None

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
        self.needles = Needles(r["key"] for r in self.config["routes"].values())
        # A spare's refusals before its job (nobody's: its job network was empty) are not the job's.
        self.totals = _new_totals()
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
                _mark(LOG_DIR / "listening")
            while not CONFIG_PATH.exists():
                await asyncio.sleep(CONFIG_POLL_S)
            if not self._configure():
                ctx.master.shutdown()  # a spare given a bad config serves no one: the host sees it exit
                return False
        # The reverse listener's nominal target: mitmproxy connects there when a route client
        # connects (eager strategy), and never sends a request there (the addon sends each to its
        # route's upstream). Should one ever arrive, it gets a 502, not a hang.
        self._sink = await asyncio.start_server(_sink, "127.0.0.1", SINK_PORT)
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
            _mark(LOG_DIR / "ready")
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

    # -- the log

    def write(self, **fields: Any) -> None:
        line = {
            "t": _now(),
            "id": None,
            "door": "proxy",
            "method": None,
            "host": None,
            "port": None,
            "route": None,
            "path": None,
            "allowed": False,
            "reason": None,
            "status": None,
            "bytes_in": 0,
            "bytes_out": 0,
            "usage": None,
            "budget": None,
            "scrubbed": None,
        }
        line.update(fields)
        if not line.get("learned"):
            line.pop("learned", None)  # only a learned line carries the field (`learned: true`)
        for k in ("host", "path", "reason", "route", "method"):
            if isinstance(line[k], str):
                # What a line quotes (an upstream's unreadable answer, a malformed head) is scrubbed
                # of the route credentials before it is escaped and cut.
                text = _escaped(self.needles.scrub_text(line[k], "log", {}))
                line[k] = text[:LOG_FIELD] + "..." if len(text) > LOG_FIELD else text
        final = line["reason"] != "in flight"
        if final:
            self.totals["allowed" if line["allowed"] else "denied"] += 1
            if line["budget"] and self.totals["budget_exhausted"] is None:
                self.totals["budget_exhausted"] = line["budget"]
        if self._log is None:
            return
        text = json.dumps(line) + "\n"
        # Past the cap only route calls (their usage is the record's) and learned requests (what
        # `fila policy suggest` proposes) are still written, up to a last margin: both are bounded
        # by max_requests. Everything else is counted per kind in summary.json.
        kept = line["allowed"] and (line["door"] == "route" or line.get("learned"))
        room = LOG_CAP + LOG_CAP // 4 if kept else LOG_CAP
        if self._log_bytes + len(text) > room:
            kind = f"{line['door']} {'allowed' if line['allowed'] else 'denied'}: {line['reason']}"
            sup = self.totals["suppressed"]
            if kind in sup or len(sup) < 100:
                sup[kind] = sup.get(kind, 0) + 1
            else:
                sup["other"] = sup.get("other", 0) + 1
            self._summarize()
            return
        self._log.write(text)
        self._log_bytes += len(text)

    def _summarize(self, *, force: bool = False) -> None:
        """summary.json: the totals (per route usage included), rewritten atomically, so that the
        record's totals never depend on how much of the log was kept. Denials rewrite it at most
        every half second (a flood must not turn into a write storm); route calls every time."""
        now = time.monotonic()
        if self._log is None or (not force and now - self._summary_at < 0.5):
            return
        self._summary_at = now
        doc = {**self.totals, "requests": self.requests, "tokens": self.tokens, "in_flight": self.in_flight}
        doc["learning"] = bool(self.config and self.config.get("learn"))
        with contextlib.suppress(OSError):
            tmp = LOG_DIR / ".summary.tmp"
            tmp.write_text(json.dumps(doc))
            tmp.replace(LOG_DIR / "summary.json")

    def record(self, flow: http.HTTPFlow, *, allowed: bool, reason: str | None, status: int | None) -> None:
        """The one final line for an HTTP flow (each flow is logged once)."""
        if flow.metadata.get("fila_logged"):
            return
        flow.metadata["fila_logged"] = True
        m = flow.metadata
        meter: Meter | None = m.get("fila_meter")
        usage = meter.usage() if meter else None
        budget_key = m.get("fila_budget")
        limit = self.config["budget"]["max_tokens"] if self.config else None
        if m.get("fila_metered") and allowed and status is not None and 200 <= status < 300 and not usage:
            # A model call that answered without a usage report the gateway can read (a stream
            # without its usage event, a body past MAX_BODY_SCAN): unknown cost. Under a token
            # budget it spends the rest of the budget rather than counting as free.
            reason = "no readable usage in the response"
            if limit is not None:
                self.tokens = max(self.tokens, limit)
                budget_key = "max_tokens"
                reason += ": counted as the whole token budget"
        elif usage:
            self.tokens += usage["input_tokens"] + usage["output_tokens"]
        was_in_flight = m.pop("fila_in_flight", False)
        if was_in_flight:
            self.in_flight -= 1
        scrubbed = dict(m.get("fila_scrubbed") or {}) or None
        self.write(
            id=flow.id if was_in_flight else None,
            door=m.get("fila_door", "proxy"),
            method=flow.request.method,
            host=m.get("fila_host", flow.request.pretty_host),
            port=m.get("fila_port", flow.request.port),
            route=m.get("fila_route"),
            path=m.get("fila_path"),
            allowed=allowed,
            reason=reason,
            status=status,
            bytes_in=meter.bytes if meter else len(flow.response.raw_content or b"") if flow.response else 0,
            bytes_out=len(flow.request.raw_content or b""),
            usage=usage,
            budget=budget_key,
            scrubbed=scrubbed,
            learned=bool(m.get("fila_learned")),
        )
        # Only a configured route has totals (fila_route is set once the name is found).
        if route := m.get("fila_route") if m.get("fila_door") == "route" else None:
            r = self.totals["routes"].setdefault(
                route,
                {"requests": 0, "statuses": {}, "input_tokens": 0, "output_tokens": 0, "scrubbed": {}},
            )
            r["requests"] += 1
            for kind, n in (scrubbed or {}).items():
                r["scrubbed"][kind] = r["scrubbed"].get(kind, 0) + n
            key = str(status) if status is not None else "no answer" if allowed else "denied"
            r["statuses"][key] = r["statuses"].get(key, 0) + 1
            if usage:
                r["input_tokens"] += usage["input_tokens"]
                r["output_tokens"] += usage["output_tokens"]
            self._summarize(force=True)
        else:
            self._summarize()
        if m.pop("fila_slot", False) and self._slot is not None:
            self._slot.release()

    def refuse(self, flow: http.HTTPFlow, status: int, reason: str, **extra: Any) -> None:
        flow.response = _json_response(status, reason, **extra)
        self.record(flow, allowed=False, reason=reason, status=status)

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
            flow.response = _json_response(403, LEARN_REFUSED)
            return self.record(flow, allowed=False, reason=reason, status=403)
        return self.refuse(flow, 403, reason)

    @fail_closed(_deny_http)
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
            "host": host,
            "port": port,
            "in": 0,
            "out": 0,
            "learned": learned,
        }

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
            self.write(
                door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=False,
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
            self.write(
                door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                reason=reason, status=status, bytes_in=t["in"], bytes_out=t["out"], learned=t["learned"],
            )  # fmt: skip

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        # The checked address did not accept the connection (mitmproxy answers 502).
        t = self.tunnels.pop(flow.client_conn.id, None)
        if t is not None and flow.response is not None:
            msg = flow.response.get_text(strict=False) or ""
            self.write(
                door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                reason=f"upstream: {msg[:200]}", status=flow.response.status_code, learned=t["learned"],
            )  # fmt: skip

    def client_disconnected(self, client: Any) -> None:
        # A tunnel the client closed before sending a byte (no TCP flow was ever made for it).
        t = self.tunnels.pop(client.id, None)
        if t is not None:
            self.write(
                door="proxy", method="CONNECT", host=t["host"], port=t["port"], allowed=True,
                status=200, bytes_in=t["in"], bytes_out=t["out"], learned=t["learned"],
            )  # fmt: skip

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self._tunnel_done(flow, None, 200)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self._tunnel_done(flow, f"upstream: {flow.error.msg if flow.error else 'error'}", 502)

    # -- both doors: every HTTP request that is not a CONNECT

    @fail_closed(_deny_http)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        if self.config is None:
            return self.refuse(flow, 503, "gateway has no config")
        if flow.error is not None:
            # mitmproxy already refused it (smuggling-prone headers: both Content-Length and
            # Transfer-Encoding, ...) and answers 400 itself; this hook only lets it be seen.
            flow.metadata.update(fila_door=self._door(flow), fila_path=_escaped(flow.request.path))
            return self.record(
                flow, allowed=False, reason=f"refused by the proxy: {flow.error.msg}"[:LOG_FIELD], status=400
            )
        if _header_bytes(flow.request) > MAX_HEADER_BYTES:
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
            flow.metadata.update(fila_host=None, fila_port=None, fila_path=_escaped(path))
            return self.refuse(flow, 404, "unknown route")
        flow.metadata.update(fila_route=name, fila_host=route["host"], fila_port=route["port"])
        if problem := _unsafe_request(req):
            # Whatever reaches the upstream's HTTP/1 head must be what was checked here: no CR or
            # LF (a second request, another path, the real key with it), no byte parsed otherwise.
            return self.refuse(flow, 400, problem)
        if any(seg in (".", "..") for seg in rest.split("/")) or any(c in rest for c in "%\\;"):
            # Encoded slashes and dots, backslashes and `;` parameters: each server normalises
            # them its own way, so a path that matched a rule here could be another one there.
            return self.refuse(flow, 400, "path with dot segments, %-escapes, \\ or ;")
        if req.headers.get("upgrade"):
            # A websocket (or h2c) upgrade would carry model traffic the meter never sees.
            return self.refuse(flow, 403, "protocol upgrade on a route")
        upath = route["base_path"] + rest
        if not any(req.method == m and rx.match(upath) for m, rx in route["paths"]):
            return self.refuse(flow, 403, "path not allowed on this route")
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
        for h in (*CREDENTIAL_HEADERS, route["header"]):
            req.headers.pop(h, None)
        for q in CREDENTIAL_QUERY:
            if q in req.query:
                del req.query[q]
        query = req.path.split("?", 1)[1] if "?" in req.path else ""
        req.scheme = route["scheme"]
        req.host = route["host"]
        req.port = route["port"]
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

    @fail_closed(_deny_http)
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

    @fail_closed(_deny_response)
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
            resp.stream = _guarded(refusal)
            return
        body = SseScrubber(self.needles, counts)
        resp.stream = _guarded(lambda chunk: body(meter(chunk)))  # the meter reads what the upstream sent

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

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("fila_logged"):
            return
        if flow.request.method == "CONNECT":
            if isinstance(flow.client_conn.proxy_mode, ReverseMode):
                # mitmproxy refuses a CONNECT on the route port before any hook sees it: no
                # tunnel will log it, so this is its line.
                flow.metadata.update(fila_door="route", fila_path=_escaped(flow.request.path))
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
