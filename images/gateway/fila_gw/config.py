"""The gateway's settings (environment, limits, the container's paths) and its config file, read and checked
(`load_config`): a config it cannot load stops the gateway (fila_gateway.py's contract).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .policy import HOSTNAME, NUMERIC_HOST, is_ip

CONFIG_PATH = Path(os.environ.get("FILA_GATEWAY_CONFIG", "/etc/fila-gateway/config.json"))
SECRETS_DIR = Path(os.environ.get("FILA_GATEWAY_SECRETS", "/run/fila-gateway/secrets"))
LOG_DIR = Path(os.environ.get("FILA_GATEWAY_LOG_DIR", "/var/log/fila-gateway"))
PROXY_PORT = int(os.environ.get("FILA_GATEWAY_PROXY_PORT", "3128"))
ROUTE_PORT = int(os.environ.get("FILA_GATEWAY_ROUTE_PORT", "8080"))
SINK_PORT = int(os.environ.get("FILA_GATEWAY_SINK_PORT", "3127"))  # the route door's reverse target (master.py)
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


# The doors' sockets bound by launch.py before the proxy started (none when it is run
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
# [A-Za-z0-9._-], a last `/**` any rest of the path): the model calls the engines make, not the
# upstream's whole API (files, batches, fine-tuning: unmetered cost, other work's data). A route's
# `paths` in the config replaces these.
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
# What `**` (a rule's last segment: a registry's deep paths) matches: the rest of the path, any
# number of segments of RFC 3986's path characters but `;` (the door refuses it), `%2F` the only
# escape (npm's scoped names, `@scope%2Fname`; the door refuses dot segments after decoding it).
REST = r"(?:[A-Za-z0-9._~!$&'()*+,=:@/-]|%2[fF])*"


def path_rule_ok(path: str) -> bool:
    """A rule's path: no dot segment; `**` only as its whole last segment."""
    segs = path.split("/")
    if any(seg in (".", "..") for seg in segs):
        return False
    return "**" not in path or (path.endswith("/**") and "**" not in path[:-3])


def path_rule(path: str) -> re.Pattern[str]:
    """The regex of a rule's path: `*` one segment of [A-Za-z0-9._-], a last `/**` the rest."""
    head, rest = (path[:-2], REST) if path.endswith("/**") else (path, "")
    body = "[A-Za-z0-9._-]+".join(re.escape(x) for x in head.split("*"))
    return re.compile(f"^{body}{rest}$")


# The model calls whose responses carry usage: only these are metered, serialised under a token
# budget, and read for usage (any other body is not a usage report, whatever it says).
METERED = re.compile(r"(/messages|/chat/completions|/responses|:generateContent|:streamGenerateContent)$")

# Headers that carry a credential on some model API: whatever the engine sends is dropped.
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization")
CREDENTIAL_QUERY = ("key",)
# Headers some servers and frameworks read as another method or another path than the request
# line's: a route's rules check the request line only, so whatever the client sends of these is
# dropped on every route.
OVERRIDE_HEADERS = (
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-url",
    "x-rewrite-url",
)
# A Basic credential's password is looked for on its own (besides `user:password` and the base64)
# only from this length: a shorter one would match ordinary text of the answers.
MIN_PASSWORD_NEEDLE = 8
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
    if not HOSTNAME.match(bare) or NUMERIC_HOST.match(bare) or is_ip(bare):
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
        if m is None or not path_rule_ok(m[2]):
            raise ConfigError(
                f'routes.{name}.paths: {rule!r} is not "METHOD /path" (* is one segment, a last /** the rest)'
            )
        rules.append((m[1], path_rule(m[2])))
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
        "host": parts.hostname.lower().rstrip("."),
        "port": parts.port or (443 if parts.scheme == "https" else 80),
        "base_path": parts.path.rstrip("/"),
        "header": header.lower(),
        "value": fmt.replace("{key}", key),
        "key": key,
        "needles": [key, *basic_parts(fmt, key)],
        "paths": rules,
    }


def basic_parts(fmt: str, key: str) -> list[str]:
    """What a `Basic {key}` credential holds besides its base64: the decoded `user:password` and
    the password alone (from MIN_PASSWORD_NEEDLE characters), each a form of the secret an answer
    must not carry (fila.egress.config.basic_parts is the host's twin, for the logs)."""
    if not re.fullmatch(r"(?i)basic \{key\}", fmt.strip()):
        return []
    try:
        plain = base64.b64decode(key, validate=True).decode()
    except ValueError:
        return []
    password = plain.split(":", 1)[1] if ":" in plain else ""
    return [plain] + ([password] if len(password) >= MIN_PASSWORD_NEEDLE else [])


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
