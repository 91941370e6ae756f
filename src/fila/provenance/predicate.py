"""fila's two in-toto predicates (docs/provenance.md): the run (how DIFF.patch was made) and the
decision (who applied or rejected it, chained to the run by digest), and the in-toto Statement v1
that carries each with DIFF.patch as its subject.

The models are the predicates' one source: `fila schema provenance` prints their JSON Schema and
`schemas/provenance.schema.json` is a generated copy the tests keep in sync. `facts` is the part
of a run predicate that the task's record states too: verification builds it again from the
record and names every field that differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.models import Policy, Record, Task

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
RUN_TYPE = "https://fila.dev/provenance/run/v1"
DECISION_TYPE = "https://fila.dev/provenance/decision/v1"
SUBJECT = "DIFF.patch"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskFacts(_Strict):
    id: str = Field(description="the task's id: a statement is about this task only (no replay)")
    prompt_sha256: str = Field(description="sha256 of the prompt (TASK.md) as UTF-8")
    task_sha256: str = Field(
        description="sha256 of the whole task document (every field: command, options, limits, check...) "
        "as canonical JSON, keys sorted"
    )
    targets: list[str] = Field(description="the paths copied into the job, relative to the project")
    engine: str = Field(description="the engine the task named")
    model: str | None = Field(description="the model the task named, if any")
    fallback: list[str] | None = Field(description="the fallback engines the task named")
    group: str | None = Field(description="its compare group, if any")


class PolicyFacts(_Strict):
    name: str
    sha256: str = Field(description="sha256 of the policy file's bytes as the run read them")


class ImageFacts(_Strict):
    tag: str = Field(description="the engine image's tag: its version as fila names it")
    id: str | None = Field(description="the image id (sha256:...) the container ran")


class AttemptFacts(_Strict):
    engine: str
    outcome: str | None = Field(description="success, quota (fell back), failed, ...")
    exit_code: int | None
    image: ImageFacts | None
    model: str | None = Field(description="the model the engine reported using, if it said")


class EgressFacts(_Strict):
    allowed: int = Field(description="requests the gateway let through")
    denied: int = Field(description="requests the gateway refused")
    hosts_allowed: list[str] = Field(description="host:port reached")
    hosts_denied: list[str] = Field(description="host:port refused")
    route_requests: int = Field(description="model route calls")
    input_tokens: int
    output_tokens: int
    credentials_scrubbed: int = Field(description="times an upstream echoed an injected credential, scrubbed")
    budget_exhausted: str | None


class CheckFacts(_Strict):
    command: str
    exit_code: int | None
    passed: bool
    timed_out: bool


class ResultFacts(_Strict):
    status: str = Field(description="the record's status when signed: needs_review")
    patch_sha256: str | None = Field(description="sha256 of DIFF.patch: the statement's subject")
    files: int
    insertions: int
    deletions: int
    credentials_replaced: int = Field(description="known credentials fila replaced by a marker in DIFF.patch")


class EnvironmentFacts(_Strict):
    """The project environment the engines and the check ran in (docs/environments.md)."""

    key: str = Field(description="sha256 of everything its setup depended on")
    source: str = Field(description="where the project declared it")
    image_id: str | None = Field(description="the environment's image")
    engine_images: dict[str, str | None] = Field(description="each engine's image id on it")


class Facts(_Strict):
    """What the record states too: built again from the record at verification."""

    task: TaskFacts
    policy: PolicyFacts | None
    backend: str | None = Field(description="the container backend: docker, podman")
    attempts: list[AttemptFacts] = Field(
        description="the engines of the claim that made DIFF.patch, in order (a fallback adds one)"
    )
    egress: EgressFacts | None = Field(description="network allowlist: what the gateway saw")
    check: CheckFacts | None = Field(description="the task's check command, when it ran")
    environment: EnvironmentFacts | None = Field(
        default=None, description="the project environment, when the project declared one"
    )
    result: ResultFacts


class Limits(_Strict):
    network: str
    memory: str
    cpus: float
    pids: int
    max_timeout_ms: int
    max_diff_bytes: int
    max_work_bytes: int
    max_work_files: int
    runtime: str | None
    images: list[str]
    waived: list[str] = Field(description="limits the backend left unenforced (the policy's waive)")


class Runner(_Strict):
    host: str = Field(description="the host that ran the task (a PostgreSQL runner's host id)")
    queue: Literal["file", "postgresql"]


class RunPredicate(_Strict):
    """How DIFF.patch was made: predicate type https://fila.dev/provenance/run/v1."""

    model_config = ConfigDict(extra="forbid", title="fila run provenance")

    facts: Facts
    limits: Limits | None = Field(description="what the policy set, when its file was the one the run read")
    inputs_sha256: str | None = Field(
        description="sha256 of the input manifest (path, kind, mode, size, sha256 of each file)"
    )
    log_sha256: str | None = Field(description="sha256 of the engine's log")
    check_log_sha256: str | None = Field(description="sha256 of the check's log")
    runner: Runner
    submitted_at: str
    started_at: str | None
    finished_at: str


class DigestRef(_Strict):
    sha256: str


class Base(_Strict):
    inputs_sha256: str | None = Field(description="the input manifest the patch was made on")
    git_commit: str | None = Field(description="the project's HEAD when it landed, when it is a git checkout")
    merged: list[str] = Field(description="paths merged with --3way onto a moved base")


class DecisionPredicate(_Strict):
    """Who decided: predicate type https://fila.dev/provenance/decision/v1."""

    model_config = ConfigDict(extra="forbid", title="fila decision provenance")

    task_id: str
    action: Literal["applied", "rejected"]
    by: str
    at: str
    reason: str | None
    run: DigestRef = Field(
        description="sha256 of the run statement (the run envelope's payload) it decides on"
    )
    base: Base | None = Field(description="an apply: what the patch landed on")
    host: str


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def facts(rec: Record) -> Facts:
    """The record's side of a run statement."""
    t = rec.task
    if t is None:
        raise ValueError(f"task {rec.id}'s record has no task")
    eg = rec.egress
    egress = None
    if eg is not None:
        hosts = {True: set(), False: set()}  # type: dict[bool, set[str]]
        for r in eg.requests:
            if r.host:
                hosts[r.allowed].add(f"{r.host}:{r.port}" if r.port else r.host)
        egress = EgressFacts(
            allowed=eg.allowed,
            denied=eg.denied,
            hosts_allowed=sorted(hosts[True]),
            hosts_denied=sorted(hosts[False]),
            route_requests=sum(s.requests for s in eg.routes.values()),
            input_tokens=sum(s.input_tokens for s in eg.routes.values()),
            output_tokens=sum(s.output_tokens for s in eg.routes.values()),
            credentials_scrubbed=sum(sum(s.scrubbed.values()) for s in eg.routes.values()),
            budget_exhausted=eg.budget_exhausted,
        )
    ds = rec.diffstat
    creds = rec.credentials_in_diff
    return Facts(
        task=TaskFacts(
            id=rec.id,
            prompt_sha256=sha256(t.prompt.encode()),
            task_sha256=task_digest(t),
            targets=list(t.targets),
            engine=t.engine,
            model=t.model,
            fallback=t.fallback,
            group=t.group,
        ),
        policy=PolicyFacts(name=rec.policy.name, sha256=rec.policy.sha256) if rec.policy else None,
        backend=rec.backend,
        attempts=[
            AttemptFacts(
                engine=a.engine,
                outcome=a.outcome,
                exit_code=a.exit_code,
                image=ImageFacts(tag=a.image.tag, id=a.image.id) if a.image else None,
                model=a.engine_report.model if a.engine_report else None,
            )
            for a in rec.attempts
            if a.run is None or a.run == rec.attempt
        ],
        egress=egress,
        check=CheckFacts(
            command=rec.check.command,
            exit_code=rec.check.exit_code,
            passed=rec.check.passed,
            timed_out=rec.check.timed_out,
        )
        if rec.check
        else None,
        environment=EnvironmentFacts(
            key=rec.environment.key,
            source=rec.environment.source,
            image_id=rec.environment.image.id if rec.environment.image else None,
            engine_images={k: v.id for k, v in rec.environment.engine_images.items()},
        )
        if rec.environment
        else None,
        result=ResultFacts(
            status=str(rec.status),
            patch_sha256=rec.patch_sha256,
            files=ds.files if ds else 0,
            insertions=ds.insertions if ds else 0,
            deletions=ds.deletions if ds else 0,
            credentials_replaced=sum(creds.counts.values()) if creds else 0,
        ),
    )


def task_digest(task: Task) -> str:
    doc = task.model_dump(mode="json", exclude_none=True)
    return sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def limits(policy: Policy, rec: Record) -> Limits:
    return Limits(
        network=policy.network,
        memory=policy.memory,
        cpus=policy.cpus,
        pids=policy.pids,
        max_timeout_ms=policy.max_timeout_ms,
        max_diff_bytes=policy.max_diff_bytes,
        max_work_bytes=policy.max_work_bytes,
        max_work_files=policy.max_work_files,
        runtime=policy.runtime,
        images=list(policy.images),
        waived=list(rec.waived),
    )


def statement(patch_sha256: str, predicate_type: str, predicate: BaseModel) -> dict[str, Any]:
    """An in-toto Statement v1 about DIFF.patch."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": SUBJECT, "digest": {"sha256": patch_sha256}}],
        "predicateType": predicate_type,
        "predicate": predicate.model_dump(mode="json"),
    }


def schema() -> dict[str, Any]:
    """The JSON Schema of both predicates (`fila schema provenance`, schemas/provenance.schema.json)."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema(
        [(RunPredicate, "validation"), (DecisionPredicate, "validation")],
        title="fila provenance predicates",
        description=f"{RUN_TYPE}: RunPredicate; {DECISION_TYPE}: DecisionPredicate. Each is the "
        "predicate of an in-toto Statement v1 whose subject is DIFF.patch (docs/provenance.md).",
    )
    top["anyOf"] = [{"$ref": "#/$defs/RunPredicate"}, {"$ref": "#/$defs/DecisionPredicate"}]
    return top
