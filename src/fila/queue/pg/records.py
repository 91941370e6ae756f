"""The review record of a task in the PostgreSQL queue: the same JSON, the same transitions and
the same checks as the file queue's (queue/store.py's ALLOWED, RUN_FIELDS and field_problem), built
here without writing a file (docs/architecture.md, "The queue's contract"). Times are the
database's clock, passed in by the caller."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ...core.models import Record, Status
from ..store import claim_changes, next_record


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
