"""The file formats: task, policy and review record.

These pydantic models are the one source of truth for each format: `fila schema task|policy|record`
prints the JSON Schema generated from them, files are validated against that schema (so errors
name the field; a file these models accept in strict mode is one the schema accepts, and skips it:
policy.validate_document), and `schemas/*.json` in the repository and `_schemas.json` beside this
module (read instead of generating the schema in every process) are generated copies tests keep in
sync.

One module on purpose (about 600 lines): the three formats share their field types (sizes, ids,
limits, errors, attempts), and the schema generator and `_schemas.json` take them as one set.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

# Re-exported: the names and ids that need no pydantic (the CLI imports them at start-up).
from .states import ID_PATTERN, ErrorKind, Status, valid_id  # noqa: F401

SIZE_PATTERN = r"^[0-9]+[kmgKMG]?$"
_SIZE_RE = re.compile(SIZE_PATTERN)


def parse_size(value: str) -> int:
    """'512m' -> bytes. Sizes are Docker's: k, m, g are powers of 1024."""
    if not _SIZE_RE.fullmatch(value):
        raise ValueError(f"not a size: {value!r} (use e.g. 512m or 2g)")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    unit = value[-1].lower()
    if unit in units:
        return int(value[:-1]) * units[unit]
    return int(value)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


Size = Annotated[str, Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g")]

# Floors and ceilings of every resource a policy grants or a task narrows.
# Docker reads 0 (and an empty value) as "no limit" or "the daemon's default" for memory, cpus,
# pids and tmpfs sizes, and an overflowing size wraps; so no value below a floor that still runs
# something, or above a ceiling that fits every kernel interface, is ever accepted. A task's
# narrowing meets the same floors as the policy it narrows.
MiB = 1 << 20
MIN_MEMORY = 6 * MiB  # Docker's own floor ("Minimum memory limit allowed is 6MB")
MIN_SIZE = 1 * MiB  # tmpfs and fsize: 0 is "unlimited" for a tmpfs, and nothing can be written below this
MAX_SIZE = 1 << 40  # 1 TiB: far above any sandbox, far below int64 overflow
MIN_CPUS = 0.01  # Docker's floor; nano_cpus >= 10_000_000, never rounded to 0
MAX_CPUS = 1024.0
MIN_PIDS = 4  # docker-init, sh, one command and a child: fewer runs nothing
MAX_PIDS = 4_194_304  # the kernel's PID_MAX_LIMIT
MIN_NOFILE = 16
MAX_NOFILE = 1_048_576  # the kernel's default nr_open: a higher hard limit fails at start
MAX_TIMEOUT_MS = 30 * 24 * 3600 * 1000  # 30 days: timeouts and grace are fila's, not Docker's
MAX_COUNT = 1 << 40  # byte and entry caps fila enforces itself (max_*_bytes, max_work_files)


def _size_within(minimum: int, maximum: int = MAX_SIZE) -> AfterValidator:
    """A size that parses to bytes within [minimum, maximum]: "0", "0k" and "9999999999999g" fail."""

    def check(value: str) -> str:
        n = parse_size(value)
        if not minimum <= n <= maximum:
            raise ValueError(f"{value!r} is {n} bytes: allowed {minimum // MiB}m to {maximum // (1 << 30)}g")
        return value

    return AfterValidator(check)


MemorySize = Annotated[
    str,
    Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g; at least 6m, at most 1024g"),
    _size_within(MIN_MEMORY),
]
LimitSize = Annotated[
    str,
    Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g; at least 1m, at most 1024g"),
    _size_within(MIN_SIZE),
]
Cpus = Annotated[float, Field(strict=True, ge=MIN_CPUS, le=MAX_CPUS, allow_inf_nan=False)]
Pids = Annotated[int, Field(strict=True, ge=MIN_PIDS, le=MAX_PIDS)]
Millis = Annotated[int, Field(strict=True, gt=0, le=MAX_TIMEOUT_MS)]
# A task's own timeout: below a second no engine even starts, so a shorter one only makes a
# failure on purpose (1 ms tasks would trip the breaker).
MIN_TASK_TIMEOUT_MS = 1000
TaskMillis = Annotated[int, Field(strict=True, ge=MIN_TASK_TIMEOUT_MS, le=MAX_TIMEOUT_MS)]
Count = Annotated[int, Field(strict=True, gt=0, le=MAX_COUNT)]


class Limits(BaseModel):
    """What a task may ask for: each value must be at most the policy's."""

    model_config = ConfigDict(extra="forbid")
    memory: MemorySize | None = None
    cpus: Cpus | None = None
    pids: Pids | None = None


class Task(BaseModel):
    """A task file, `fila/in/<id>.json`."""

    model_config = ConfigDict(extra="forbid", title="fila task")

    id: str | None = Field(
        default=None,
        pattern=ID_PATTERN,
        description="task id; the file name's stem when absent. Letters, digits, '.', '_', '-'.",
    )
    prompt: str = Field(default="", description="what the engine is asked to do (TASK.md)")
    engine: str = Field(description="engine name: shell, claude, codex, ...")
    model: str | None = Field(default=None, description="model name passed to the engine")
    timeout: TaskMillis | None = Field(
        default=None, description="wall-clock limit in milliseconds; at least 1000, at most the policy's cap"
    )
    targets: list[str] = Field(min_length=1, description="paths relative to the project; directories allowed")
    policy: str = Field(default="default", pattern=ID_PATTERN, description="policy name")
    command: str | None = Field(
        default=None,
        description="shell engine: run with sh -c in work/ (the older form of options.shell.command)",
    )
    options: dict[Annotated[str, Field(pattern=ID_PATTERN)], dict[str, Any]] | None = Field(
        default=None,
        description='each engine\'s own options, under its name: {"shell": {"command": "make fmt"}}; only '
        "engines the task runs (its engine and fallback) may have an entry",
    )
    fallback: list[str] | None = Field(
        default=None,
        description="engines tried in turn when one reports quota, each on a fresh work/; "
        "absent: the policy's fallback chain; []: none",
    )
    project: str | None = Field(default=None, description="project directory (default: the queue root)")
    image: str | None = Field(default=None, description="engine image; must be allowed by policy")
    limits: Limits | None = Field(default=None, description="narrow the policy's resources")
    group: str | None = Field(
        default=None,
        pattern=ID_PATTERN,
        description="compare group: tasks on the same input, one per engine (`fila compare GROUP`)",
    )
    check: str | None = Field(
        default=None,
        min_length=1,
        description="command run by sh -c on a copy of work/ after the engine succeeds (shell image, "
        "network none); its exit status is recorded",
    )
    submitter: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="who or what queued it, as it says (e.g. mcp:<client> for the MCP server): shown, "
        "never trusted",
    )

    environment: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="the project environment the engine and the check run in: a declaration's path "
        'relative to the project (a devcontainer.json or fila-environment.json), or "none"; absent: '
        "the project's own .devcontainer/devcontainer.json, .devcontainer.json or fila-environment.json "
        "when it has one (docs/environments.md)",
    )
    environment_digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="what the project's environment must be made of (its base image's id, the "
        "declaration, the inputs: set by `fila submit` where it can tell): a runner whose own "
        "declaration or base image makes another fails the task (kind environment) rather than set "
        'up a different one (docs/environments.md, "Many hosts")',
    )

    @field_validator("targets")
    @classmethod
    def _targets_not_empty(cls, v: list[str]) -> list[str]:
        for t in v:
            if not t or "\x00" in t:
                raise ValueError("a target must be a non-empty path")
        return v


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


class ImageRef(BaseModel):
    tag: str
    id: str | None = None


class PolicyRef(BaseModel):
    name: str
    sha256: str


class ErrorInfo(BaseModel):
    kind: ErrorKind
    message: str


class DiffStat(BaseModel):
    files: int = 0
    insertions: int = 0
    deletions: int = 0
    binary: int = 0
    paths: list[str] = Field(default_factory=list)


class CredentialsFound(BaseModel):
    """Known credentials (a route's key, an engine's secret) found in what the engine changed and
    replaced in DIFF.patch by a marker: named and counted, never the value."""

    counts: dict[str, int] = Field(
        description='occurrences replaced, per credential ("route anthropic", "engine variable X")'
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="escaped path -> sha256 of the file as the patch writes it (the marker in place "
        "of the credential); apply --allow-credential checks what it stages against it",
    )


class Attempt(BaseModel):
    """One engine's run of the task: a claim runs the task's engine, then each fallback engine
    on quota, and each is an attempt of its own."""

    number: int = Field(
        description="1, 2, ... in the record's order (records of older versions: the claim's count)"
    )
    run: int | None = Field(
        default=None,
        description="the claim it ran under (the record's `attempt` then): the engines of one run "
        "share it; absent in records of older versions",
    )
    engine: str
    worker: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    outcome: str | None = Field(
        default=None, description="success, quota (fell back), failed, or the worker's hand back"
    )
    error: ErrorInfo | None = None
    # What the engine ran on and what it reported (older versions: for an engine that fell back only).
    image: ImageRef | None = None
    exit_code: int | None = None
    log_path: str | None = None
    egress: EgressRecord | None = None
    engine_report: EngineReport | None = None
    duration_s: float | None = Field(
        default=None, description="the engine's container from its start to its exit (engine time)"
    )
    cut_short: str | None = Field(
        default=None,
        description="why fila stopped the engine before it ended: an upstream's quota answer in the "
        "gateway log while a fallback engine was waiting (docs/engines.md)",
    )


class CheckResult(BaseModel):
    """The task's `check` command, run after the engine on a copy of its work/ (network none)."""

    command: str
    passed: bool
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    log_path: str | None = None
    image: ImageRef | None = None


class Workspace(BaseModel):
    """How the job's input/ and work/ were made: `copy` (the targets copied twice into the job
    directory) or `overlay` (input/ a shared read-only snapshot, work/ an overlay of it with the
    job's own upper layer), and why; the snapshot's key and whether it was built or reused."""

    strategy: Literal["copy", "overlay"]
    why: str
    snapshot: str | None = None
    snapshot_how: str | None = Field(default=None, description="built, reused (stat pass only) or rehashed")
    files_read: int | None = Field(default=None, description="project files read to check or build it")


class EnvironmentRecord(BaseModel):
    """The project environment a task ran in (docs/environments.md, "In the record")."""

    key: str = Field(description="sha256 of everything the setup depended on")
    source: str = Field(description="where the project declared it, relative to the project")
    form: str = Field(description="devcontainer or fila")
    name: str | None = None
    image: ImageRef | None = Field(default=None, description="the environment image (the setup's result)")
    how: Literal["built", "cached", "failed"] = Field(description="built for this task, or found by its key")
    setup_s: float | None = Field(default=None, description="the setup's duration when it was built")
    log_path: str | None = Field(default=None, description="the setup's log (relative to the root)")
    egress: EgressRecord | None = Field(default=None, description="what the setup's gateway saw")
    build_egress: EgressRecord | None = Field(
        default=None,
        description="what the gateway of the project Dockerfile's RUN steps saw (built for this task)",
    )
    provided: list[str] = Field(
        default_factory=list, description="project paths the environment provides read-only, never diffed"
    )
    engine_images: dict[str, ImageRef] = Field(
        default_factory=dict, description="each engine's image on this environment"
    )
    warnings: list[str] = Field(default_factory=list, description="what reading the declaration said")
    digest: str | None = Field(
        default=None,
        description="what it is made of (base, declaration, inputs); the key adds the setup policy",
    )
    pinned: str | None = Field(
        default=None, description="the digest the task was submitted with (the submitter's host made it)"
    )


class Decision(BaseModel):
    action: Literal["applied", "rejected", "retried", "superseded"]
    by: str
    at: str
    reason: str | None = None


class EgressRequest(BaseModel):
    """One decision of the gateway, as it logged it (egress.jsonl)."""

    t: str | None = None
    id: str | None = Field(
        default=None, description="a route call's id: its in-flight line, then its final one"
    )
    door: str | None = None
    method: str | None = None
    host: str | None = None
    port: int | None = None
    route: str | None = None
    path: str | None = None
    allowed: bool = False
    reason: str | None = None
    status: int | None = None
    bytes_in: int | None = None
    bytes_out: int | None = None
    usage: dict[str, int] | None = None
    budget: str | None = None
    scrubbed: dict[str, int] | None = Field(
        default=None,
        description="a route call's answer: the injected credential replaced, per kind (where it was: "
        "status, header, body, trailer; how: :base64, :url, :json; body:split: spread over stream "
        "events), or refused:compressed (the answer refused whole)",
    )
    learned: bool = Field(default=False, description="allowed only because the policy was learning")


class RouteSummary(BaseModel):
    requests: int = 0
    statuses: dict[str, int] = Field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    scrubbed: dict[str, int] = Field(
        default_factory=dict,
        description="the route's upstream echoed the injected credential: replaced (or the answer "
        "refused) before the engine saw it, counted per kind as in the request lines",
    )


class EgressRecord(BaseModel):
    """What the job's gateway saw: each request (capped), per route totals, the budget."""

    requests: list[EgressRequest] = Field(default_factory=list)
    dropped: int = Field(default=0, description="lines not kept (cap, unreadable)")
    routes: dict[str, RouteSummary] = Field(default_factory=dict)
    allowed: int = 0
    denied: int = 0
    budget_exhausted: str | None = Field(default=None, description="max_requests or max_tokens")
    in_flight: int = Field(
        default=0,
        description="route calls unfinished when the log ended (the gateway died: may be unmetered)",
    )
    learning: bool = Field(default=False, description="the policy was learning (egress.learn)")
    learned: list[str] = Field(
        default_factory=list, description="host:port the gateway let through only because it was learning"
    )


class EngineReport(BaseModel):
    """What the engine CLI itself reported in its structured output (absent where it says nothing),
    beside what the gateway measured in `egress`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    turns: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: float | None = None
    session_id: str | None = None
    message: str | None = Field(default=None, description="the CLI's own final or error message")


class Record(BaseModel):
    """The review record, `fila/out/<id>.json`. Written atomically by `queue.transition_locked` only
    (under the record lock; `queue.set_status` is its usual caller)."""

    model_config = ConfigDict(title="fila review record")

    id: str
    status: Status
    task: Task | None = Field(default=None, description="absent only for a file that never parsed")
    engine: str | None = None
    model: str | None = None
    image: ImageRef | None = None
    policy: PolicyRef | None = None
    attempt: int = 0
    attempts: list[Attempt] = Field(default_factory=list)
    worker: str | None = None
    not_before: float | None = Field(default=None, description="backoff: not claimed before")
    container: str | None = None
    container_started: bool = False
    exit_code: int | None = None
    error: ErrorInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict, description="seconds per phase")
    submitted_at: str = Field(default_factory=now_iso)
    updated_at: str = Field(default_factory=now_iso)
    diffstat: DiffStat | None = None
    patch_sha256: str | None = None
    patch_path: str | None = None
    log_path: str | None = None
    warnings: list[str] = Field(default_factory=list)
    decision: Decision | None = None
    diagnosis: str | None = None
    egress: EgressRecord | None = Field(default=None, description="network allowlist: the gateway's log")
    backend: str | None = Field(default=None, description="the container backend that ran it: docker, podman")
    waived: list[str] = Field(
        default_factory=list,
        description="limits of the policy the backend left unenforced (the policy's waive)",
    )
    engine_report: EngineReport | None = Field(
        default=None, description="what the engine CLI reported: model, turns, usage, cost"
    )
    check: CheckResult | None = Field(default=None, description="the task's check command, when it ran")
    workspace: Workspace | None = Field(default=None, description="how input/ and work/ were made, and why")
    environment: EnvironmentRecord | None = Field(
        default=None, description="the project environment the engine and the check ran in"
    )
    credentials_in_diff: CredentialsFound | None = Field(
        default=None,
        description="known credentials replaced in DIFF.patch by a marker; apply refuses the task "
        "unless --allow-credential",
    )

    @field_validator("task", mode="wrap")
    @classmethod
    def _recorded_task(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Task | None:
        """A record is history: a task recorded before today's floors (memory "0" queued by an
        older fila) still loads, so ls, show and the worker keep working. It never runs as it is:
        the task file is checked again at claim, and narrow and create_kwargs check its limits."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, dict) or not isinstance(value.get("limits"), dict):
                raise
            # Only the limits are taken as recorded; every other field must still validate (a
            # record changed outside fila is refused, not carried with fields of any type).
            task = handler({k: v for k, v in value.items() if k != "limits"})
            return task.model_copy(update={"limits": Limits.model_construct(**value["limits"])})

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=False) + "\n"


def schema_for(name: str) -> dict[str, Any]:
    models: dict[str, type[BaseModel]] = {"task": Task, "policy": Policy, "record": Record}
    return models[name].model_json_schema()


# The schemas generated once and stored beside the code (`_schemas.json`, written by
# `python -m fila.entry --write`): generating them costs 10-20 ms a format in every process that
# validates a task or a policy (every submit, every worker's first claim). They are used only while
# the sources they came from are these (core/models.py, core/states.py and pydantic's version), so an edited
# model is validated against its own schema, generated, until the file is written again; and only
# while the file is owned like core/models.py and not group/other-writable (stored.stored_bytes): its key
# is computed from public sources, so anyone who could write it could choose what is accepted.
_STORED = Path(__file__).with_name("_schemas.json")


def _schema_key() -> str:
    import hashlib

    import pydantic

    h = hashlib.sha256(pydantic.VERSION.encode())
    for source in ("models.py", "states.py"):
        h.update(Path(__file__).with_name(source).read_bytes())
    return h.hexdigest()


def published_schema(name: str) -> dict[str, Any]:
    """`schema_for(name)`, read from `_schemas.json` when that was generated from these sources
    and is owned like this module."""
    from .stored import stored_bytes

    raw = stored_bytes(str(_STORED), __file__)  # None: missing, unreadable or not to be trusted
    try:
        stored = json.loads(raw) if raw is not None else None
        if stored is not None and stored["key"] == _schema_key():
            return dict(stored["schemas"][name])
    except (OSError, ValueError, KeyError, TypeError):  # another layout
        pass
    return schema_for(name)


def write_stored_schemas() -> Path:
    schemas = {name: schema_for(name) for name in ("task", "policy", "record")}
    from .fsutil import atomic_write

    # 0644 whatever the umask: a group-writable copy would be ignored (published_schema).
    atomic_write(_STORED, json.dumps({"key": _schema_key(), "schemas": schemas}, indent=1) + "\n", mode=0o644)
    return _STORED
