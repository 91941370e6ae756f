"""The review record format, `fila/out/<id>.json` (docs/architecture.md): a task's status, its
attempts, what its gateway saw, its diff's summary and the decision on it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from ..states import ErrorKind, Status
from .fields import now_iso
from .task import Limits, Task


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
