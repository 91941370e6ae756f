"""The review record of a task in the PostgreSQL queue: the same JSON, the same transitions and
the same checks as the file queue's (queue/store.py's ALLOWED, RUN_FIELDS and field_problem), built
here without writing a file (docs/architecture.md, "The queue's contract"). Times are the
database's clock, passed in by the caller."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from ...core import untrusted
from ...core.errors import InvalidInput, InvalidTaskFile, InvalidTransition, Refused
from ...core.models import Attempt, ErrorInfo, ErrorKind, Record, Status, Task
from ..records import claim_changes, field_problem, next_record

# The record fields a runner's checkpoint or publish may set: what its run found. The rest are
# the queue's (id, status, times, the task, its attempts, worker and container, a person's
# decision), set by the claim, mark_started, a sweep or a decision.
RESULT_FIELDS = frozenset(
    {
        "engine", "model", "image", "policy", "exit_code", "error", "timings", "diffstat",
        "patch_sha256", "patch_path", "log_path", "warnings", "diagnosis", "egress", "backend",
        "waived", "engine_report", "check", "workspace", "credentials_in_diff", "environment",
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
        msg = f"the queued task does not validate: {problem(err)}"
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


# -- reading rows as untrusted -------------------------------------------------------------------
# Whoever holds the queue's credential can write any row (docs/scale-out.md, "What fila promises"):
# a document is read as its text, through core/untrusted.py's reader (depth, size and number
# limits), never by psycopg's jsonb parser, which a document nested past Python's recursion limit
# or a number of thousands of digits crashes. One bad row then fails or is refused alone.


def json_text(text: str, *, kind: str, error: type[InvalidInput] = InvalidInput) -> Any:
    """A JSON document as the database holds it (its text), read as untrusted JSON."""
    return untrusted.parse_json(text.encode(), kind=kind, error=error, path=None)


def read_task(text: str) -> Task:
    """A queued task's document: untrusted JSON within a task file's size cap, then validated
    (InvalidTaskFile or ValidationError when not)."""
    if len(text) > untrusted.MAX_TASK_BYTES:
        raise InvalidTaskFile(f"the queued task is {len(text)} characters, above {untrusted.MAX_TASK_BYTES}")
    return Task.model_validate(json_text(text, kind="queued task", error=InvalidTaskFile))


def problem(err: ValidationError | InvalidInput) -> str:
    """The first thing wrong with a document, in one line."""
    if isinstance(err, InvalidInput):
        return err.message
    first = err.errors()[0] if err.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ())) or "document"
    return f"{where}: {first.get('msg', err)}"


def read_record(task_id: str, text: str, where: str) -> Record:
    """Task `task_id`'s record as the database `where` holds it; Refused naming the task and what
    is wrong when it does not read or validate, or names another id (its id names paths and
    blobs)."""
    try:
        rec = Record.model_validate(json_text(text, kind="record"))
    except (InvalidInput, ValidationError) as e:
        raise Refused(
            f"task {task_id!r}: its record in the queue database {where} cannot be read: {problem(e)}",
            task_id=task_id,
            hint="the row was changed outside fila; a person decides what it should say",
        ) from None
    bad = field_problem(rec)  # readable, but no state fila could move it on from
    if bad:
        raise Refused(
            f"task {task_id!r}: its record in the queue database {where} cannot be read: {bad}",
            task_id=task_id,
            hint="the row was changed outside fila; a person decides what it should say",
        )
    if rec.id != task_id:
        raise Refused(
            f"task {task_id!r}: its record in the queue database {where} names id {rec.id!r}",
            task_id=task_id,
            hint="nothing was read further; the row was changed outside fila",
        )
    return rec


def event_line(at: str, event: str, text: str) -> dict[str, Any]:
    """One event row as a line of events.jsonl ({"at", "event", ...its data}): its data read as
    untrusted (one appended outside fila says it is unreadable, and cannot rename the event)."""
    try:
        data = json_text(text, kind="event")
    except InvalidInput as e:
        data = {"unreadable": e.message}
    extra = {k: v for k, v in data.items() if k not in ("at", "event")} if isinstance(data, dict) else {}
    return {"at": at, "event": event, **extra}
