"""The policy format, `policies/<name>.json` (README.md, docs/environments.md): the resources
and network a task is granted (its egress allowlist, routes and budget) and what a project
environment's setup may do."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from .fields import MAX_NOFILE, MIN_NOFILE, Count, Cpus, LimitSize, MemorySize, Millis, Pids

RUNTIME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _absolute_dir(value: str) -> str:
    if not value.startswith("/") or "\x00" in value:
        raise ValueError(f"{value!r} is not an absolute directory")
    return value


class Tmpfs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tmp: LimitSize = "256m"
    home: LimitSize = "256m"


HOST_PATTERN = r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
HTTP_METHOD_PATTERN = r"^[A-Z]{1,16}$"
ROUTE_PATH_PATTERN = r"^[A-Z]{1,16} /[A-Za-z0-9._:/*-]{0,500}$"
# A setup route's name: its variable (FILA_ROUTE_<NAME>) must be a shell name.
SETUP_ROUTE_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"


class AllowEntry(BaseModel):
    """One host the engine may reach through the gateway's forward proxy."""

    model_config = ConfigDict(extra="forbid")
    host: str = Field(
        max_length=253, pattern=HOST_PATTERN, description="a DNS name, or *.suffix for its subdomains"
    )
    port: int = Field(default=443, ge=1, le=65535)
    methods: list[Annotated[str, Field(pattern=HTTP_METHOD_PATTERN)]] | None = Field(
        default=None,
        description="plain-HTTP methods allowed (e.g. GET, HEAD); null: any. An entry with methods is "
        "reached by plain HTTP only (no CONNECT: a tunnel shows no method), so not on port 443",
    )


class Route(BaseModel):
    """A model route: the gateway forwards /<name>/... to `upstream`, adding the real credential."""

    model_config = ConfigDict(extra="forbid")
    upstream: str | None = Field(
        # \x1c-\x1f spelled out: Python's \s has them, the models' regex engine's does not, and the
        # schema and the models must refuse the same names (policy.validate_document).
        default=None,
        pattern=r"^https?://[^/?#@\s\x1c-\x1f]+(/[A-Za-z0-9._~!$&'()*+,=:@-]+)*/?$",
        description="default: the known route's; a path (a registry's repository) is the base of every "
        "request the route sends",
    )
    credential: str | None = Field(
        default=None, pattern=ENV_NAME_PATTERN, description="name of the host environment variable"
    )
    credential_file: str | None = Field(
        default=None, description="file holding the credential (regular, owned by fila's user, 0600)"
    )
    header: str | None = Field(default=None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    format: str | None = Field(default=None, description="header value, with {key}")
    ca_file: str | None = Field(default=None, description="CA bundle the gateway trusts for upstream")
    paths: list[Annotated[str, Field(pattern=ROUTE_PATH_PATTERN)]] | None = Field(
        default=None,
        min_length=1,
        description='"METHOD /upstream/path" rules the route allows (* is one path segment of '
        "[A-Za-z0-9._-]; a last /** is the rest of the path, any number of segments); default: the known "
        "route's model calls, for a setup route GET and HEAD of /**",
    )


class Egress(BaseModel):
    """What `network: allowlist` lets out, through the job's gateway."""

    model_config = ConfigDict(extra="forbid")
    allow: list[AllowEntry] = Field(default_factory=list)
    routes: dict[str, Route] = Field(default_factory=dict, description="anthropic, openai, gemini")
    allow_private: list[str] = Field(
        default_factory=list, description="CIDRs of private addresses allowed (internal mirrors)"
    )
    max_requests: Count | None = Field(
        default=None, description="route requests per job (learning: learned connections too); learn needs it"
    )
    max_tokens: Count | None = Field(default=None, description="input + output tokens per job")
    egress_network: str = Field(
        default="fila-egress",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="Docker network the gateway reaches upstreams on",
    )
    learn: bool = Field(
        default=False,
        description="let unlisted public hosts on ports 80 and 443 through and log them as learned "
        "(`fila policy suggest` proposes the allowlist); needs max_requests",
    )


def _registry(host: str, port: int = 443, methods: list[str] | None = None) -> AllowEntry:
    return AllowEntry(host=host, port=port, methods=methods)


# The package registries a setup reaches when the operator's policy names none: PyPI's, npm's and
# Debian's (apt fetches over plain HTTP, so GET and HEAD only there: docs/environments.md).
SETUP_REGISTRIES: tuple[tuple[str, int, tuple[str, ...] | None], ...] = (
    ("pypi.org", 443, None),
    ("files.pythonhosted.org", 443, None),
    ("registry.npmjs.org", 443, None),
    ("deb.debian.org", 80, ("GET", "HEAD")),
    ("deb.debian.org", 443, None),
    ("security.debian.org", 80, ("GET", "HEAD")),
)


class SetupPolicy(BaseModel):
    """What a project environment's setup may do (docs/environments.md, "The setup"): it runs once
    per environment key, as root in its container but with no added capability, and reaches only
    these hosts through a gateway of its own; nothing of it reaches a task's engine but the image
    it leaves."""

    model_config = ConfigDict(extra="forbid")
    allow: list[AllowEntry] = Field(
        default_factory=lambda: [_registry(h, p, list(m) if m else None) for h, p, m in SETUP_REGISTRIES],
        description="hosts the setup may reach through its gateway (default: PyPI, npm and Debian); "
        "empty: no network during the setup",
    )
    allow_private: list[str] = Field(
        default_factory=list, description="CIDRs of private addresses allowed (an internal mirror)"
    )
    max_requests: Count | None = Field(default=None, description="requests per setup; learn needs it")
    egress_network: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="Docker network the setup's gateway reaches upstreams on (default: egress's, "
        "else fila-egress)",
    )
    learn: bool = Field(
        default=False, description="let unlisted public hosts through and log them as learned (egress.learn)"
    )
    ca_file: str | None = Field(
        default=None,
        description="a CA bundle on this host the setup's package managers trust (a TLS-intercepting "
        "proxy between the gateway and the registries); never part of the environment's image",
    )
    routes: dict[Annotated[str, Field(pattern=SETUP_ROUTE_PATTERN)], Route] = Field(
        default_factory=dict,
        description="a private registry the setup reaches through its gateway, which adds the credential "
        "(the setup never holds it): the setup finds the route's URL in FILA_ROUTE_<NAME>; upstream is "
        "required; header default authorization, format default 'Bearer {key}'",
        json_schema_extra={"additionalProperties": False},
    )
    timeout_ms: Millis = Field(default=20 * 60 * 1000, description="the whole setup's wall-clock limit")
    memory: MemorySize = "4g"
    cpus: Cpus = 2.0
    pids: Pids = 2048
    fsize: LimitSize = Field(default="4g", description="largest file the setup may write (ulimit)")
    max_image_bytes: Count = Field(
        default=16 << 30, description="largest environment image the setup may leave (bytes)"
    )


class Policy(BaseModel):
    """A policy file, `policies/<name>.json`. A task may narrow it, never widen it."""

    model_config = ConfigDict(extra="forbid", title="fila policy")

    description: str = ""
    network: Literal["none", "bridge", "allowlist"] = Field(
        default="none",
        description="none: no network at all; bridge: Docker's default bridge; "
        "allowlist: only the egress hosts and routes, through a per-job gateway",
    )
    egress: Egress | None = Field(default=None, description="network allowlist: hosts, routes, budget")
    max_timeout_ms: Millis = Field(description="cap for a task's timeout")
    default_timeout_ms: Millis = Field(description="timeout when the task gives none; at most max_timeout_ms")
    grace_ms: Millis = Field(default=10_000, description="SIGTERM to SIGKILL grace period")
    memory: MemorySize = "2g"
    cpus: Cpus = 1.0
    pids: Pids = 256
    nofile: int = Field(
        default=4096, strict=True, ge=MIN_NOFILE, le=MAX_NOFILE, description="open files ulimit"
    )
    fsize: LimitSize = Field(default="1g", description="largest file the engine may write (ulimit)")
    tmpfs: Tmpfs = Field(default_factory=Tmpfs)
    deny: list[str] = Field(
        default_factory=list, description="rules (.gitignore syntax) for paths never copied into a job"
    )
    max_prompt_bytes: Count = Field(
        default=256 << 10, description="largest prompt a task may give, in UTF-8 bytes (TASK.md, argv)"
    )
    max_diff_bytes: Count = 20 << 20
    max_log_bytes: Count = 10 << 20
    max_work_bytes: Count = Field(default=1 << 30, description="total size of work/")
    max_work_files: Count = Field(default=50_000, description="entries in work/")
    images: list[str] = Field(
        default_factory=lambda: ["fila/*"],
        description="globs of allowed images; an image id (sha256:...) is allowed when one of its tags is",
    )
    fallback: list[str] = Field(
        default_factory=list, description="engines tried on quota when a task names no fallback"
    )
    runtime: str | None = Field(
        default=None, pattern=RUNTIME_PATTERN, description="Docker runtime, e.g. runsc (a name only)"
    )
    waive: list[Literal["memory", "pids", "cpus"]] = Field(
        default_factory=list,
        description="limits the container backend may leave unenforced on its host (rootless Podman on "
        "cgroup v1 enforces none of them); without this, such a policy is refused before the job starts. "
        "A waiver is kept in the record and shown by fila review",
    )
    max_consecutive_failures: int = Field(
        default=5, strict=True, gt=0, le=1000, description="circuit breaker"
    )
    environment: SetupPolicy = Field(
        default_factory=SetupPolicy,
        description="a project environment's setup: its hosts, time and resources (docs/environments.md)",
    )
    projects: list[Annotated[str, Field(pattern=r"^/"), AfterValidator(_absolute_dir)]] = Field(
        default_factory=list,
        description="directories a task may name as its project, absolute, each exactly (not below it); "
        "the queue root is always allowed. Empty: the queue root only",
    )

    @model_validator(mode="after")
    def _default_within_cap(self) -> Policy:
        if self.default_timeout_ms > self.max_timeout_ms:
            raise ValueError(
                f"default_timeout_ms {self.default_timeout_ms} is above max_timeout_ms {self.max_timeout_ms}"
            )
        return self
