"""`network: allowlist`: the job's own network and egress gateway, from policy to record.

Per job (docs/architecture.md, "Threat model in brief"): an internal bridge network with no IPv4 on the bridge
(so the engine cannot reach host services through the bridge address), a gateway container
(`fila/gateway:latest`, mitmproxy with fila's addon) on that network and on the egress network,
and the engine on the job network only, with the gateway as its proxy, its resolver and its model
routes. The real credentials exist only in the secrets directory mounted into the gateway; the
engine holds the placeholder key. After the engine container is gone the gateway, the network and
the secrets are removed, and the gateway's log becomes the record's `egress` section.

Everything is labelled (`fila=1`, `fila.job`, `fila.role`, `fila.root`) so `fila recover` sweeps
what a killed fila left (`sweep`).

This module is the policy's side and the gateway's setup; what the gateway logged, read into the
record and shown, is `egress.record`'s (its names are importable from here too).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import re
import secrets as _secrets
import shutil
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..core.errors import InvalidPolicy
from ..core.models import EgressRecord, Policy, Route
from .record import budget_message as budget_message
from .record import learned_text as learned_text
from .record import learning_messages as learning_messages
from .record import lines as lines
from .record import read_log
from .record import scrub_messages as scrub_messages

GATEWAY_IMAGE = "fila/gateway:latest"
ROLE_LABEL = "fila.role"
ROLE_GATEWAY = "gateway"
ROLE_JOB_NET = "job-net"
ROLE_EGRESS_NET = "egress-net"
ROLE_NETNS = "netns"
DEFAULT_EGRESS_NETWORK = "fila-egress"
PROXY_PORT = 3128
ROUTE_PORT = 8080
PLACEHOLDER_KEY = "fila-placeholder"
CONF_DIR = "/etc/fila-gateway"  # mounted read-only from the gateway directory's conf/
CONFIG_PATH = f"{CONF_DIR}/config.json"
UPSTREAM_CA_PATH = f"{CONF_DIR}/upstream-ca.pem"
# Set on every gateway fila starts: it binds its listeners before its config is there and loads
# the config as soon as it appears (a spare waits for its job; images/gateway/fila_gateway.py).
WAIT_ENV = {"FILA_GATEWAY_WAIT": "1"}
SPARE_LABEL = "fila.spare"
SECRETS_PATH = "/run/fila-gateway/secrets"
LOG_PATH = "/var/log/fila-gateway"
READY_TIMEOUT_S = 20.0
# The usual ports a learning gateway lets an unlisted name through on (docs/security.md, "Learn,
# then lock"); any other port stays "not in allowlist" while learning.
LEARN_PORTS = (80, 443)
GATEWAY_MEMORY = 256 << 20
GATEWAY_PIDS = 128


@dataclass(frozen=True)
class KnownRoute:
    upstream: str
    header: str
    format: str
    base_url_env: str
    base_url_suffix: str  # what the engine's SDK expects after the route (OpenAI's includes /v1)
    key_env: str


KNOWN_ROUTES: dict[str, KnownRoute] = {
    "anthropic": KnownRoute(
        "https://api.anthropic.com", "x-api-key", "{key}", "ANTHROPIC_BASE_URL", "", "ANTHROPIC_API_KEY"
    ),
    "openai": KnownRoute(
        "https://api.openai.com", "authorization", "Bearer {key}", "OPENAI_BASE_URL", "/v1", "OPENAI_API_KEY"
    ),
    "gemini": KnownRoute(
        "https://generativelanguage.googleapis.com",
        "x-goog-api-key",
        "{key}",
        "GOOGLE_GEMINI_BASE_URL",
        "",
        "GEMINI_API_KEY",
    ),
}

# Names that resolve to this machine, the local network or a cloud's metadata service: never
# allowed, whatever they resolve to today (the gateway also checks every address it resolves, and
# refuses these same names, learning or not: its RESERVED_NAMES / RESERVED_SUFFIXES; a test keeps
# the lists equal).
_PRIVATE_NAMES = {
    "localhost",
    "localhost.localdomain",
    "ip6-localhost",
    "ip6-loopback",
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "instance-data",
}
_PRIVATE_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".lan", ".home.arpa", ".arpa")


# -- the policy ----------------------------------------------------------------------------------


def _bad(field: str, message: str, path: Path | str | None, hint: str | None = None) -> InvalidPolicy:
    return InvalidPolicy(f"policy field {field!r}: {message}", hint=hint, path=path)


def _is_ip_literal(host: str) -> bool:
    h = host.strip("[]").rstrip(".")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(h)
        return True
    # 2130706433, 0x7f.1, 127.1: forms inet_aton accepts that ip_address does not.
    labels = h.split(".")
    return all(lbl.isdigit() or lbl.lower().startswith("0x") for lbl in labels if lbl)


def private_name(host: str) -> bool:
    h = host.lower().rstrip(".")
    if h.startswith("*."):
        h = h[2:]
    return h in _PRIVATE_NAMES or h.endswith(_PRIVATE_SUFFIXES) or "." + h in _PRIVATE_SUFFIXES


def validate(policy: Policy, *, path: Path | str | None = None) -> None:
    """Everything about `network`/`egress` (and the setup's routes) a schema cannot say; errors
    name the field (exit 2)."""
    validate_setup(policy, path=path)
    eg = policy.egress
    if policy.network != "allowlist":
        if eg is not None:
            raise _bad(
                "egress",
                f"set while network is {policy.network!r}",
                path,
                'use "network": "allowlist", or remove egress',
            )
        return
    if eg is not None and eg.learn and eg.max_requests is None:
        raise _bad(
            "egress.max_requests",
            "a learning policy (egress.learn) needs a bound: learned connections count against it",
            path,
            'e.g. "max_requests": 500 beside "learn": true',
        )
    if eg is None or (not eg.allow and not eg.routes and not eg.learn):
        raise _bad(
            "egress",
            "network allowlist needs at least one egress.allow entry or egress.routes route",
            path,
            'e.g. "egress": {"allow": [{"host": "registry.npmjs.org"}]}',
        )
    for i, entry in enumerate(eg.allow):
        field = f"egress.allow.{i}.host"
        if _is_ip_literal(entry.host):
            raise _bad(field, f"{entry.host!r} is an IP address; list host names only", path)
        if private_name(entry.host):
            raise _bad(field, f"{entry.host!r} is a private or metadata name", path)
        if entry.methods is not None and entry.port == 443:
            # Port 443 is reached through a CONNECT tunnel, where the gateway sees no method: the
            # gateway refuses CONNECT for a method-limited entry, so this entry would open nothing.
            raise _bad(
                f"egress.allow.{i}.methods",
                "methods limit plain HTTP only; port 443 is reached by CONNECT (TLS): no method is seen",
                path,
                "remove methods (the whole host:443 is open), or list a plain-HTTP port (80)",
            )
    for i, cidr in enumerate(eg.allow_private):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError as e:
            raise _bad(f"egress.allow_private.{i}", f"not a CIDR: {e}", path) from None
    for name, route in eg.routes.items():
        if name not in KNOWN_ROUTES:
            raise _bad(f"egress.routes.{name}", f"unknown route {name!r}", path,
                       f"known routes: {', '.join(sorted(KNOWN_ROUTES))}")  # fmt: skip
        _validate_route(f"egress.routes.{name}", route, path)


def validate_setup(policy: Policy, *, path: Path | str | None = None) -> None:
    """The setup's routes (docs/environments.md, "Secrets for the setup"): each names its upstream
    (no known default applies), a credential, and a name no engine route has."""
    for name, route in policy.environment.routes.items():
        base = f"environment.routes.{name}"
        if name in KNOWN_ROUTES:
            raise _bad(base, f"{name!r} is an engine route's name", path, "name the setup's route otherwise")
        if route.upstream is None:
            raise _bad(f"{base}.upstream", "a setup route needs its upstream", path,
                       'e.g. "upstream": "https://pypi.corp.example"')  # fmt: skip
        host = urlsplit(route.upstream).hostname or ""
        if _is_ip_literal(host) or private_name(host):
            raise _bad(f"{base}.upstream", f"{host!r} is an IP address or a private name; name a host", path)
        _validate_route(base, route, path)


def _validate_route(base: str, route: Route, path: Path | str | None) -> None:
    upstream_path = urlsplit(route.upstream).path if route.upstream is not None else ""
    if any(seg in (".", "..") for seg in upstream_path.split("/")):
        raise _bad(f"{base}.upstream", f"{route.upstream!r} has a dot segment", path)
    if (route.credential is None) == (route.credential_file is None):
        raise _bad(base, "give exactly one of credential (a variable name) or credential_file", path)
    if route.ca_file is not None:
        try:
            st = os.stat(route.ca_file)
        except OSError as e:
            raise _bad(f"{base}.ca_file", f"cannot read {route.ca_file}: {e.strerror}", path) from None
        if not stat.S_ISREG(st.st_mode):
            raise _bad(f"{base}.ca_file", f"{route.ca_file} is not a regular file", path)
    if route.format is not None and "{key}" not in route.format:
        raise _bad(f"{base}.format", "must contain {key}", path)
    for i, rule in enumerate(route.paths or []):
        rule_path = rule.split(" ", 1)[1]
        if any(seg in (".", "..") for seg in rule_path.split("/")):
            raise _bad(f"{base}.paths.{i}", f"{rule!r} has a dot segment", path)
        if "**" in rule_path and not (rule_path.endswith("/**") and "**" not in rule_path[:-3]):
            raise _bad(f"{base}.paths.{i}", f"{rule!r}: ** is only the whole last segment (/**)", path)


def check_credentials(policy: Policy, routes: Collection[str], *, path: Path | str | None = None) -> None:
    """The credentials of `routes` (the ones a task's engines use) can be read: a variable that is
    set, a file of fila's user that no one else may read. A route no engine of the task uses needs
    no credential, so a policy may name every vendor a team uses."""
    eg = policy.egress
    for name in routes:
        route = eg.routes.get(name) if eg else None  # a route the policy lacks is check_task's to say
        if route is not None:
            check_credential(f"egress.routes.{name}", route, path)


def check_credential(base: str, route: Route, path: Path | str | None = None) -> None:
    """`route`'s credential can be read: a variable that is set, or a file of fila's user that no
    one else may read. InvalidPolicy naming `base` and the variable or file."""
    if route.credential is not None and not os.environ.get(route.credential):
        raise _bad(
            f"{base}.credential",
            f"the environment variable {route.credential} is not set",
            path,
            f"export {route.credential} in the environment fila runs in",
        )
    if route.credential_file is not None:
        _check_secret_file(f"{base}.credential_file", Path(route.credential_file), path)


def only_routes(policy: Policy, routes: Collection[str]) -> Policy:
    """`policy` with only `routes` of its egress routes: the gateway of a job gets the keys its
    engines use and no other (docs/architecture.md, "Threat model in brief")."""
    eg = policy.egress
    if eg is None or set(eg.routes) <= set(routes):
        return policy
    kept = {k: v for k, v in eg.routes.items() if k in routes}
    return policy.model_copy(update={"egress": eg.model_copy(update={"routes": kept})})


def _check_secret_file(field: str, p: Path, path: Path | str | None) -> None:
    try:
        st = os.lstat(p)
    except OSError as e:
        raise _bad(field, f"cannot read {p}: {e.strerror}", path) from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(field, f"{p} is not a regular file (a symlink or special file is refused)", path)
    if st.st_uid != os.getuid():
        raise _bad(field, f"{p} is owned by uid {st.st_uid}, not by fila's user ({os.getuid()})", path)
    if st.st_mode & 0o077:
        raise _bad(
            field,
            f"{p} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o})",
            path,
            f"chmod 600 {p}",
        )


@dataclass(frozen=True)
class Resolved:
    name: str
    upstream: str
    header: str
    format: str
    key: str
    ca_file: str | None
    paths: list[str] | None = None  # None: the gateway's default for the known route


# A setup route (a registry) when its policy says no more: the bearer scheme, reads of any path.
SETUP_HEADER = "authorization"
SETUP_FORMAT = "Bearer {key}"
SETUP_PATHS = ("GET /**", "HEAD /**")


def route_shape(name: str, r: Route) -> tuple[str, str, str, list[str] | None]:
    """What a route sends where, defaults filled in, without its credential: the upstream, the
    header, its format and the path rules (None: the gateway's default for a known route). A name
    no engine route has is a setup route (validate_setup: its upstream is given)."""
    known = KNOWN_ROUTES.get(name)
    if known is None:
        assert r.upstream is not None
        return (r.upstream.rstrip("/"), (r.header or SETUP_HEADER).lower(), r.format or SETUP_FORMAT,
                list(r.paths or SETUP_PATHS))  # fmt: skip
    return ((r.upstream or known.upstream).rstrip("/"), (r.header or known.header).lower(),
            r.format or known.format, r.paths)  # fmt: skip


def read_credential(base: str, r: Route) -> str:
    """The route's credential as the gateway gets it: the variable's value, or the file's first
    64 KiB (never through a link), stripped. InvalidPolicy naming `base` when unreadable or empty."""
    if r.credential is not None:
        key = os.environ.get(r.credential, "")
    else:
        assert r.credential_file is not None
        field = f"{base}.credential_file"
        try:
            fd = os.open(r.credential_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as e:
            raise _bad(field, f"cannot read {r.credential_file}: {e.strerror}", None) from None
        try:
            key = raw.decode().strip()
        except UnicodeDecodeError as e:
            raise _bad(field, f"{r.credential_file} is not UTF-8 text (byte {e.start})", None) from None
    if not key:
        raise _bad(base, "the credential is empty", None)
    return key


# A Basic credential's password is a form of it too, from this length (shorter would match
# ordinary text; the gateway's MIN_PASSWORD_NEEDLE and secretscan's MIN_CHARS are the same).
MIN_PASSWORD_CHARS = 8


def credential_forms(fmt: str, key: str) -> list[str]:
    """The credential as a log or an answer may show it: the key, and for a `Basic {key}` format
    (the key the base64 of `user:password`) the decoded `user:password` and the password alone
    (images/gateway/fila_gw/config.py `basic_parts` is the gateway's twin, for its answers)."""
    forms = [key]
    if re.fullmatch(r"(?i)basic \{key\}", fmt.strip()):
        try:
            plain = base64.b64decode(key, validate=True).decode()
        except ValueError:
            return forms
        password = plain.split(":", 1)[1] if ":" in plain else ""
        forms += [plain] + ([password] if len(password) >= MIN_PASSWORD_CHARS else [])
    return forms


def resolve_routes(policy: Policy) -> list[Resolved]:
    """The policy's routes (an engine's, or a setup's in the policy env/build.py makes for it)
    with the defaults filled in and the credential read."""
    eg = policy.egress
    out = []
    for name, r in (eg.routes if eg else {}).items():
        upstream, header, fmt, paths = route_shape(name, r)
        key = read_credential(f"egress.routes.{name}", r)
        out.append(Resolved(name, upstream, header, fmt, key, r.ca_file, paths))
    return out


# -- the job's network and gateway ---------------------------------------------------------------


@dataclass
class Gateway:
    """A job's gateway, or a spare one (`job_id` empty until a job takes it: egress/pool.py)."""

    job_id: str
    network: str
    container: str
    ip: str
    dir: Path
    routes: list[str]
    subnets: list[str] = field(default_factory=list)  # the job network's: the gateway's only clients
    spare: str | None = None  # the spare's id when it came from a pool (its lock, its labels)
    # A spare's network namespace holder on the job network (Docker): the engine joins its
    # namespace, set up before the job, instead of the daemon attaching it to the network at start.
    netns: str | None = None
    # Its directory is removed already (a spare after its job): `dir` may be the next attempt's.
    dir_gone: bool = False
    # Whether it serves already; False between `configure(early=True)` (its sockets bound) and
    # `wait_serving`, which the engine's start does not wait for (sandbox/docker/egress.py).
    serving: bool = True
    # Killed after the engine's exit, before its log is read (sandbox/docker/egress.halt): its log
    # is whole, and its not running is no loss.
    halted: bool = False
    # Not running any more, whoever stopped it (halt's kill, or its own death halt found): its
    # removal leaves no network behind (sandbox/docker/removal.py: no departure lock for it).
    stopped: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # gateway_start/_take, _ready, _serve, _remove
    # Called once the gateway, its network and its directory are gone (a pool's spare lets go of
    # its lock, which until then tells recovery its owner is alive).
    released: Callable[[], None] | None = field(default=None, repr=False)
    # Waited for between the removal of its containers and its job network's (the engine's
    # container, removed beside them, must be off the network first), when its remover is not told.
    before_network: Callable[[], None] | None = field(default=None, repr=False)

    def engine_env(self) -> dict[str, str]:
        proxy = f"http://{self.ip}:{PROXY_PORT}"
        env = {k: proxy for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
        # Gemini CLI and qwen CONNECT even for plain http: the routes must bypass the proxy.
        env |= {"NO_PROXY": self.ip, "no_proxy": self.ip}
        for name in self.routes:
            base = f"http://{self.ip}:{ROUTE_PORT}/{name}"
            env[f"FILA_ROUTE_{name.upper()}"] = base
            known = KNOWN_ROUTES.get(name)
            if known is not None:
                env[known.base_url_env] = base + known.base_url_suffix
                env[known.key_env] = PLACEHOLDER_KEY
        return env


def job_labels(job_id: str, role: str, extra: dict[str, str]) -> dict[str, str]:
    return {**extra, "fila": "1", "fila.job": job_id, ROLE_LABEL: role}


def network_name(job_id: str) -> str:
    return f"fila-net-{job_id[:90]}-{_secrets.token_hex(4)}"


def _write_private(path: Path, data: bytes, uid: int, gid: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        if (uid, gid) != (os.getuid(), os.getgid()):
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)


def make_gateway_dir(state: Path, uid: int, gid: int) -> None:
    """state/ (0700, the host's), made empty before the gateway starts: conf/ (config.json and
    upstream-ca.pem, mounted read-only at CONF_DIR), secrets/ and log/ (the gateway's uid's)."""
    if state.exists():
        remove_dir(state)
    state.mkdir(mode=0o700, parents=True)
    os.chmod(state, 0o700)
    (state / "conf").mkdir(mode=0o755)
    os.chmod(state / "conf", 0o755)
    for d in (state / "secrets", state / "log"):
        d.mkdir(mode=0o700)
        if (uid, gid) != (os.getuid(), os.getgid()):
            os.chown(d, uid, gid)


def write_gateway_config(
    state: Path, policy: Policy, job_id: str, uid: int, gid: int, *, clients: list[str]
) -> list[Resolved]:
    """The job's secrets, upstream CA and config into a gateway directory made by
    make_gateway_dir; the config last, renamed into place whole, since a started gateway loads it
    the moment it appears. `clients`: the job network's subnets, the only peers the gateway serves
    (its key and budget are this job's: an engine of another job reaching it through a broad
    allow_private is refused)."""
    assert policy.egress is not None
    routes = resolve_routes(policy)
    sdir, conf = state / "secrets", state / "conf"
    cas = [r.ca_file for r in routes if r.ca_file]
    if cas:
        bundle = b"".join(Path(c).read_bytes().rstrip(b"\n") + b"\n" for c in dict.fromkeys(cas))
        (conf / "upstream-ca.pem").write_bytes(bundle)
        os.chmod(conf / "upstream-ca.pem", 0o644)
    for r in routes:
        _write_private(sdir / r.name, r.key.encode(), uid, gid)
    eg = policy.egress
    config = {
        "job": job_id,
        "allow": [e.model_dump() for e in eg.allow],
        "allow_private": list(eg.allow_private),
        "routes": {
            r.name: {
                "upstream": r.upstream,
                "header": r.header,
                "format": r.format,
                "secret": r.name,
                "paths": r.paths,
            }
            for r in routes
        },
        "budget": {"max_requests": eg.max_requests, "max_tokens": eg.max_tokens},
        "upstream_ca": UPSTREAM_CA_PATH if cas else None,
        "clients": clients,
        "host_addresses": host_addresses(),
        "learn": {"ports": list(LEARN_PORTS)} if eg.learn else None,
    }
    tmp = conf / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    os.chmod(tmp, 0o644)
    tmp.replace(conf / "config.json")
    return routes


def prepare_gateway_dir(
    state: Path, policy: Policy, job_id: str, uid: int, gid: int, *, clients: list[str]
) -> list[Resolved]:
    """make_gateway_dir, then write_gateway_config: a gateway directory ready before its start."""
    make_gateway_dir(state, uid, gid)
    return write_gateway_config(state, policy, job_id, uid, gid, clients=clients)


def host_addresses() -> list[str]:
    """This machine's own addresses (IPv4 local routes of /proc/net/fib_trie, IPv6 of
    /proc/net/if_inet6): the gateway never connects to them, public or not (a listed wildcard name
    resolving to the host would otherwise reach its services through the egress bridge)."""
    out: set[str] = set()
    with contextlib.suppress(OSError):
        prev = ""
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            if "/32 host LOCAL" in line and prev:
                out.add(prev)
            parts = line.split()
            prev = parts[1] if len(parts) == 2 and parts[0] in ("|--", "+--") else ""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            raw = line.split()[0]
            out.add(str(ipaddress.IPv6Address(int(raw, 16))))
    return sorted(out)


def move_dir(src: Path, dst: Path) -> None:
    """A gateway directory moved whole (one rename, same filesystem) to `dst`, whatever was
    there removed first (an earlier attempt's)."""
    dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    remove_dir(dst)
    os.rename(src, dst)


def remove_dir(state: Path) -> None:
    """The job's gateway directory, secrets included; never following a link out of it."""
    with contextlib.suppress(FileNotFoundError):
        if state.is_symlink() or not state.is_dir():
            state.unlink()
            return
        shutil.rmtree(state)


# -- the record (read by egress/record.py) -------------------------------------------------------


def collect(gw: Gateway) -> EgressRecord:
    log = gw.dir / "log"
    rec = read_log(log / "egress.jsonl", summary=log / "summary.json", routes=gw.routes)
    # Whether the job was learning is the host's own config (written by write_gateway_config), not
    # anything the gateway or the engine said.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        rec.learning = bool(json.loads((gw.dir / "conf" / "config.json").read_text()).get("learn"))
    return rec


# -- crash recovery ------------------------------------------------------------------------------


def sweep_dirs(meta_dir: Path, has_claim: Callable[[str, str | None], bool]) -> list[str]:
    """Remove the gateway directories (secrets) of jobs whose worker holds no claim."""
    from ..core.models import valid_id

    removed = []
    if meta_dir.is_dir():
        for d in meta_dir.glob("*/egress"):
            tid = d.parent.name
            if valid_id(tid) and not has_claim(tid, None):
                remove_dir(d)
                removed.append(f"gateway directory {d}")
    return removed
