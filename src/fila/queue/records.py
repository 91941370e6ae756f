"""The records of the file queue and their one state machine (docs/architecture.md, "The
queue's contract"): reading a record and its events, the transitions allowed, and the one
function that writes a record (`transition_locked`, under the record lock).

`next_record` is pure, so the PostgreSQL queue (queue/pg/records.py) builds its records with the
same checks; the claims that decide who may write live in queue/store.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import DuplicateId, InvalidTransition, NotFound, RecordMismatch
from ..core.faults import crash_point
from ..core.layout import Root, check_id
from ..core.models import Attempt, ErrorInfo, Record, Status, Task, now_iso

S = Status
# docs/architecture.md, "The queue's contract"; README.md lists the transitions. A running ->
# running change is a checkpoint or a fallback.
ALLOWED: dict[Status | None, set[Status]] = {
    None: {S.queued, S.failed},  # failed: a dropped task file that did not validate
    S.queued: {S.running, S.failed},  # failed: invalid when claimed (e.g. target deleted)
    S.running: {S.running, S.needs_review, S.failed, S.queued, S.needs_human},
    S.needs_review: {S.applied, S.rejected},
    S.needs_human: {S.queued, S.rejected},
    S.failed: {S.queued, S.rejected},
    S.applied: set(),
    S.rejected: set(),
}


# Fields that belong to one run: entering `queued` clears them, so a requeued or retried record
# never carries a previous run's container, exit code or diff as if they were current.
RUN_FIELDS = ("worker", "container", "exit_code", "diffstat", "patch_sha256", "patch_path", "diagnosis")


# Fields only next_record sets: a change naming one could write a record under another task's id,
# skip the transition check or rewrite the task's history.
FIXED_FIELDS = frozenset({"id", "status", "updated_at", "submitted_at"})


OUTCOME_OF = {
    S.needs_review: "success",
    S.failed: "failed",
    S.needs_human: "needs_human",
    S.queued: "requeued",
}


def read_record(root: Root, task_id: str) -> Record | None:
    path = root.record_path(task_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    rec = Record.model_validate_json(data)
    if rec.id != task_id:
        raise RecordMismatch(
            f"the record of task {task_id} names task {rec.id!r}: another task's record was "
            "copied or restored over it",
            task_id=task_id,
            path=path,
            hint=f"put task {task_id}'s own record back (or move this file aside); "
            "`fila recover` reports it until then and acts on neither task",
        )
    return rec


def get_record(root: Root, task_id: str) -> Record:
    rec = read_record(root, task_id)
    if rec is None:
        raise NotFound(f"no task {task_id!r} in {root.out_dir}", hint="`fila ls` lists tasks")
    return rec


def log_event(root: Root, task_id: str, event: str, **data: Any) -> None:
    line = json.dumps({"at": now_iso(), "event": event, **data}, default=str, sort_keys=False)
    fsutil.append_line(root.events_path(task_id), line)


def log_chunks(
    root: Root, task_id: str, *, events: bool = False, follow: bool = False, poll_s: float = 0.5
) -> Iterator[bytes]:
    """A task's engine log (or with `events` its event log) as it grows: what is there, then,
    with `follow`, what is added while the task is queued or running. NotFound for an unknown id."""
    get_record(root, task_id)
    path = root.events_path(task_id) if events else root.log_path(task_id)
    offset = 0
    while True:
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() < offset:  # a new attempt rewrote the log
                offset = 0
            f.seek(offset)
            data = f.read()
            offset += len(data)
            if data:
                yield data
        if not follow or get_record(root, task_id).status not in (S.queued, S.running):
            return
        time.sleep(poll_s)


def read_events(root: Root, task_id: str) -> list[dict[str, Any]]:
    try:
        lines = root.events_path(task_id).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


@contextlib.contextmanager
def locked(root: Root, task_id: str) -> Iterator[None]:
    """The record lock: serialises every read-check-write of one task's record and the file
    moves that go with it, between processes and threads (flock is per open file)."""
    with fsutil.file_lock(root.out_dir / f".{check_id(task_id)}.lock"):
        yield


def field_problem(rec: Record) -> str | None:
    """The combinations of fields that no reader accepts (partial state is worse than
    wrong state). set_status refuses to write a record for which this returns a reason."""
    st = rec.status
    if st in (S.queued, S.running) and rec.task is None:
        return f"a {st} record needs its task"
    if st == S.queued and (rec.worker or rec.container_started or rec.container):
        return "a queued record cannot name a worker or a container"
    if st == S.running and not rec.worker:
        return "a running record needs its worker"
    if st in (S.failed, S.needs_human) and rec.error is None:
        return f"a {st} record needs its error"
    if rec.container_started and not rec.container:
        return "container_started without a container"
    if rec.not_before is not None and st != S.queued:
        return "only a queued record has a backoff"
    if rec.attempts and st != S.running and rec.attempts[-1].ended_at is None:
        return "an attempt is open but the task is not running"
    return None


def close_attempt(attempts: list[Attempt], at: str, outcome: str, error: ErrorInfo | None) -> list[Attempt]:
    """The attempts with the open one (the last, when it has no end) ended at `at`."""
    if not attempts or attempts[-1].ended_at is not None:
        return attempts
    last = attempts[-1].model_copy(update={"ended_at": at, "outcome": outcome, "error": error})
    return [*attempts[:-1], last]


def claim_changes(cur: Record, run: int, engine: str, worker: str, at: str) -> dict[str, Any]:
    """What a claim changes in the record: run `run` (the claim's count) by `worker`, and a new
    open attempt numbered after the ones before it."""
    opened = Attempt(number=len(cur.attempts) + 1, run=run, engine=engine, worker=worker, started_at=at)
    return dict(worker=worker, attempt=run, error=None, attempts=[*cur.attempts, opened])


def next_record(
    task_id: str,
    cur: Record | None,
    to: Status,
    now: str,
    *,
    expect: set[Status] | None = None,
    task: Task | None = None,
    outcome: str | None = None,
    changes: dict[str, Any] | None = None,
) -> Record:
    """The record after one status change at time `now`, checked against ALLOWED, `expect` and
    field_problem; InvalidTransition (nothing to write) when refused. Pure: the file queue and the
    PostgreSQL queue (queue/pg/records.py) write what it returns, each in its own way."""
    changes = changes or {}
    frm = cur.status if cur else None
    fixed = sorted(FIXED_FIELDS & changes.keys())
    if fixed:
        raise InvalidTransition(
            f"refused to write task {task_id}: {', '.join(fixed)} is the queue's to set, not a change's",
            task_id=task_id,
        )
    if to not in ALLOWED[frm] or (expect is not None and frm not in expect):
        raise InvalidTransition(
            f"task {task_id} is {frm or 'unknown'}; it cannot become {to}",
            task_id=task_id,
            hint="`fila show ID` shows its state and history",
        )
    if cur is None:
        base: dict[str, Any] = {"id": task_id, "task": task, "submitted_at": now}
        if task is not None:
            base.update(engine=task.engine, model=task.model)
    else:
        base = cur.model_dump()
        if task is not None:
            base["task"] = task
    if to == S.queued:
        base.update(dict.fromkeys(RUN_FIELDS), container_started=False)
    else:
        base["not_before"] = None
    base.update(changes)
    base.update(status=to, updated_at=now)
    if to != S.running and "attempts" not in changes:
        err = base.get("error")
        base["attempts"] = close_attempt(
            [Attempt.model_validate(a) if isinstance(a, dict) else a for a in base.get("attempts", [])],
            now,
            outcome or OUTCOME_OF.get(to, str(to)),
            ErrorInfo.model_validate(err) if isinstance(err, dict) else err,
        )
    new = Record.model_validate(base)
    problem = field_problem(new)
    if problem:
        raise InvalidTransition(f"refused to write task {task_id} as {to}: {problem}", task_id=task_id)
    return new


def _write_record(path: Path, data: str, to: Status) -> None:
    """fsutil.atomic_write, with a crash point between the temp file and the rename of an
    outcome (the record write that ends a run)."""
    outcome = to not in (S.queued, S.running)
    fsutil.atomic_write(
        path, data, before_rename=(lambda: crash_point("during_record_write")) if outcome else None
    )


def transition_locked(
    root: Root,
    task_id: str,
    cur: Record | None,
    to: Status,
    *,
    expect: set[Status] | None = None,
    task: Task | None = None,
    event: str | None = None,
    log: dict[str, Any] | None = None,
    outcome: str | None = None,
    changes: dict[str, Any] | None = None,
) -> Record:
    """Check, build, validate and durably write one status change, then append its event.

    The caller holds `locked(root, task_id)` and passes the record it read under it. Use
    `set_status` unless other moves must happen under the same lock (recovery, enqueue)."""
    changes = changes or {}
    frm = cur.status if cur else None
    new = next_record(task_id, cur, to, now_iso(), expect=expect, task=task, outcome=outcome, changes=changes)
    path = root.record_path(task_id)
    if cur is None:
        if not fsutil.create_exclusive(path, new.to_json()):
            raise DuplicateId(f"task id {task_id!r} exists already", task_id=task_id)
    else:
        _write_record(path, new.to_json(), to)
    summary = {k: v for k, v in changes.items() if k in {"attempt", "worker", "exit_code"}}
    if new.error and to in {S.failed, S.needs_human, S.queued}:
        summary["error"] = new.error.model_dump(mode="json")
    log_event(root, task_id, event or "status", **{"from": frm, "to": to}, **summary, **(log or {}))
    return new


def set_status(
    root: Root,
    task_id: str,
    to: Status,
    *,
    expect: set[Status] | None = None,
    task: Task | None = None,
    event: str | None = None,
    guard: Callable[[Record | None], None] | None = None,
    log: dict[str, Any] | None = None,
    outcome: str | None = None,
    **changes: Any,
) -> Record:
    """The usual way to change a task's status: takes the record lock and calls
    `transition_locked`, the only function that writes a record (recovery and the queue's own
    moves call it directly, under the same lock).

    Under the record lock: runs `guard(current)` (which raises to refuse: fencing), checks the
    transition against ALLOWED and `expect` (the states the caller believes the task is in),
    builds and validates the whole new record (field_problem), writes it atomically and durably,
    then appends an event with `log`. Leaving `running` closes the open attempt with `outcome`.
    A refused change raises InvalidTransition (or the guard's exception) and writes nothing.
    """
    check_id(task_id)
    with locked(root, task_id):
        cur = read_record(root, task_id)
        if guard is not None:
            guard(cur)
        return transition_locked(
            root,
            task_id,
            cur,
            to,
            expect=expect,
            task=task,
            event=event,
            log=log,
            outcome=outcome,
            changes=changes,
        )


def task_json(task: Task) -> str:
    return task.model_dump_json(indent=2, exclude_none=True) + "\n"


def all_records(
    root: Root, cache: dict[str, tuple[tuple[int, int, int], Record]] | None = None
) -> list[Record]:
    """Every record in fila/out that reads. With `cache` (file name -> (its inode, size and
    mtime, the record)), kept by the caller between calls, only the files that changed since are
    parsed again: `fila serve` lists 10,000 tasks on each poll for the cost of a directory scan."""
    recs, seen, names = [], set(), []
    with contextlib.suppress(FileNotFoundError), os.scandir(root.out_dir) as it:
        names = sorted(e.name for e in it if e.name.endswith(".json") and not e.name.startswith("."))
    for name in names:
        p = root.out_dir / name
        with contextlib.suppress(FileNotFoundError, ValueError):
            if cache is None:
                recs.append(Record.model_validate_json(p.read_bytes()))
                continue
            st = os.stat(p)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            seen.add(name)
            hit = cache.get(name)
            if hit is None or hit[0] != key:
                hit = (key, Record.model_validate_json(p.read_bytes()))
                cache[name] = hit
            recs.append(hit[1])
    if cache is not None:
        for gone in set(cache) - seen:
            del cache[gone]
    return recs


# -- compare groups: the supersede an apply writes, and reading it back ---------------------------


def superseded_reason(group: str, winner: str) -> str:
    """The reason of the `superseded` decision an apply of `winner` gives the other members of
    its compare group (both queues write it; `superseded_by` reads it back)."""
    return f"group {group}: {winner} was applied"


def superseded_by(members: list[Record], group: str, winner: str) -> list[str]:
    """The ids of the `members` the apply of `winner` superseded: the answer an apply whose reply
    was lost gives again, read from the records (docs/scale-out.md)."""
    why = ("superseded", superseded_reason(group, winner))
    return [r.id for r in members if r.decision and (r.decision.action, r.decision.reason) == why]


def check_group(rec: Record, others: Iterable[Record]) -> None:
    """Refuse to apply `rec` when another member of its group was applied already, naming that
    member, who applied it and when: both queues' rule (review/groups.py for the file queue,
    PgQueue.decide_group and review/remote.py for the database)."""
    if rec.task is None or rec.task.group is None or rec.status != Status.needs_review:
        return  # not a member, or decided itself: the decision's own check says what was decided
    for other in others:
        if other.id != rec.id and other.status == Status.applied:
            d = other.decision
            raise InvalidTransition(
                f"task {rec.id} is in group {rec.task.group!r}, whose member {other.id} was applied"
                + (f" by {d.by} at {d.at}" if d else ""),
                task_id=rec.id,
                hint="one member of a group lands; `fila compare GROUP` shows them",
            )
