"""The review record of a task in the PostgreSQL queue: the same JSON, the same transitions and
the same checks as the file queue's (queue/store.py's ALLOWED, RUN_FIELDS and field_problem), built
here without writing a file (docs/architecture.md, "The queue's contract"). Times are the
database's clock, passed in by the caller."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from ...core.errors import InvalidInput, InvalidTransition
from ...core.models import Attempt, ErrorInfo, ErrorKind, Record, Status
from ..records import claim_changes, next_record

# The record fields a runner's checkpoint or publish may set: what its run found. The rest are
# the queue's (id, status, times, the task, its attempts, worker and container, a person's
# decision), set by the claim, mark_started, a sweep or a decision.
RESULT_FIELDS = frozenset(
    {
        "engine", "model", "image", "policy", "exit_code", "error", "timings", "diffstat",
        "patch_sha256", "patch_path", "log_path", "warnings", "diagnosis", "egress", "backend",
        "waived", "engine_report", "check", "workspace", "credentials_in_diff",
    }
)  # fmt: skip


def iso(at: datetime) -> str:
    """A database timestamp as the records write them (UTC, milliseconds)."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds")


def transition(task_id: str, cur: Record | None, to: Status, at: datetime, **how: Any) -> Record:
    """The record after one status change at the database's time `at`: store.next_record, whose
    keywords (expect, task, outcome, changes) `how` passes on."""
    return next_record(task_id, cur, to, iso(at), **how)


def started(task_id: str, cur: Record, at: datetime, *, runner: str, engine: str, attempt: int) -> Record:
    """queued -> running for a claim: run `attempt` (the claim's count) opens attempt number
    len(attempts) + 1, as the file queue's store.begin does."""
    return transition(
        task_id,
        cur,
        Status.running,
        at,
        expect={Status.queued},
        changes=claim_changes(cur, attempt, engine, runner, iso(at)),
    )


def on_db_clock(ran: list[Attempt], offset_s: float) -> list[Attempt]:
    """A runner's attempts with their times (written on its own wall clock) moved by `offset_s`,
    the database's clock less the runner's (Lease.clock_offset_s): a runner whose clock is off
    publishes times on the database's clock, as the rest of the record is. Durations are kept."""

    def moved(at: str | None) -> str | None:
        if at is None:
            return None
        return iso(datetime.fromisoformat(at) + timedelta(seconds=offset_s))

    return [
        a.model_copy(update={"started_at": moved(a.started_at), "ended_at": moved(a.ended_at)}) for a in ran
    ]


def this_claim(cur: Record, ran: list[Attempt], run: int, runner: str, at: datetime) -> list[Attempt]:
    """The record's attempts with claim `run`'s replaced by `ran` (a runner's view of the engines
    it ran): numbered after the earlier claims' attempts, each under claim `run` and `runner`,
    and closed at `at` when the runner left one open."""
    earlier = [a for a in cur.attempts if a.run != run]
    out = []
    for i, a in enumerate(ran):
        own = {"number": len(earlier) + i + 1, "run": run, "worker": runner}
        if a.ended_at is None:
            own["ended_at"] = iso(at)
        out.append(a.model_copy(update=own))
    return [*earlier, *out]


def result_fields(task_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` when each is one of RESULT_FIELDS; InvalidTransition (nothing written) naming
    the others."""
    other = sorted(fields.keys() - RESULT_FIELDS)
    if other:
        raise InvalidTransition(
            f"task {task_id}: a runner cannot set {', '.join(other)} of its record; the queue sets them",
            task_id=task_id,
        )
    return dict(fields)


def invalid(task_id: str, cur: Record, at: datetime, err: ValidationError | InvalidInput) -> Record:
    """queued -> failed for a claimed task whose stored document does not read or validate: its
    first problem in the error."""
    if isinstance(err, InvalidInput):
        msg = f"the queued task cannot be read: {err.message}"
    else:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())) or "task"
        msg = f"the queued task does not validate: {where}: {first.get('msg', err)}"
    error = ErrorInfo(kind=ErrorKind.invalid, message=msg)
    return transition(task_id, cur, Status.failed, at, expect={Status.queued}, changes={"error": error})


def without_repeated_hand_back(cur: Record) -> Record:
    """`cur`, whose open attempt is about to be handed back uncounted, without the attempt before
    it when that one was handed back uncounted too: a sick runner's hand-backs in a row keep the
    latest, so the record (rewritten whole at each change) stays bounded however long the host
    stays sick. Every hand-back is still an event of the task."""
    atts = cur.attempts
    if len(atts) < 2 or atts[-1].ended_at is not None or atts[-2].outcome != "handed back":
        return cur
    opened = atts[-1].model_copy(update={"number": atts[-2].number})
    return cur.model_copy(update={"attempts": [*atts[:-2], opened]})
