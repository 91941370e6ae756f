"""The PostgreSQL queue's store: submit, claim, lease, publish, sweep, retry, read
(docs/architecture.md, "The PostgreSQL queue"; the rules are "The queue's contract"); a compare
group's decision is groups.py's, the circuit breaker breaker.py's, the runners table runners.py's
(PgQueue is all three).

Every writer locks the task's row first (`FOR UPDATE`, or the UPDATE itself) and then touches its
record, events and blobs in the same transaction, so a task's four tables always agree. Only the
database's clock (`now()`) sets and judges a lease; runners never compare their own clock with it.
A claim measures how far the runner's wall clock is from the database's (Lease.clock_offset_s)
only so that the times a runner publishes (its attempts') are on the database's clock too.

Fencing and the side-effect boundary (a claim's token; the started mark before the container)
are leases.py's, the runner's side: claim, renew, the started mark, publish and hand back.


Connections, the retry of a transaction whose connection broke, reads and wake-ups are db.py's:
every operation here is safe to repeat. A claim whose commit reply was lost finds its own task
again by the random nonce it stored with it; a publish, a decision or the started mark sent again
returns what the first one wrote. Runners set only their results in a record (RESULT_FIELDS);
the queue's own fields are the queue's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from ...core.errors import (
    DuplicateId,
    FilaError,
    InvalidInput,
    InvalidTransition,
    NotFound,
)
from ...core.models import Decision, ErrorInfo, ErrorKind, Record, Status, Task
from ...core.states import valid_id
from ..retry import INFRA, RetryPolicy
from . import blobs as blobstore
from . import groups, records
from .blobs import Blob
from .breaker import PgBreaker
from .db import CHANNEL, retryable
from .groups import PgGroups
from .keys import PgKeys
from .leases import OUTCOMES as OUTCOMES
from .leases import Lease as Lease
from .leases import PgLeases, seconds
from .runners import PgRunners

S = Status
log = logging.getLogger(__name__)
# The blob that names a task's targets (path, kind, mode, sha256 of each): sent with the task,
# read by the runner that claims it, and published again with its outcome.
INPUTS = "input.manifest"


class PgQueue(PgLeases, PgGroups, PgBreaker, PgRunners, PgKeys):
    """One queue database, shared by this process's threads: the operations that change it."""

    # -- submit ---------------------------------------------------------------------------------

    def enqueue(
        self,
        task_id: str,
        task: Task,
        *,
        max_tries: int | None = None,
        notify: bool = True,
        inputs: Blob | None = None,
        files: Iterable[Blob] = (),
    ) -> Record:
        """Queue a validated task: its row, its record (queued) and its `submitted` event. An id
        that exists is refused (DuplicateId); `notify` wakes waiting runners (a hint).

        `inputs` (the targets' manifest, named INPUTS) and `files` (the bytes it names) travel in
        the same transaction: each is checked against its sha256 first (BlobMismatch: nothing
        written), and a content the database holds already is not sent again (the `submitted`
        event counts what was sent)."""
        return self.enqueue_group(
            [(task_id, task)], max_tries=max_tries, notify=notify, inputs=inputs, files=files
        )[0]

    def enqueue_group(
        self,
        tasks: list[tuple[str, Task]],
        *,
        max_tries: int | None = None,
        notify: bool = True,
        inputs: Blob | None = None,
        files: Iterable[Blob] = (),
    ) -> list[Record]:
        """Queue several validated tasks (a compare group's members, review/groups.group_tasks)
        as `enqueue` queues one, all in ONE transaction: every id is free and every task valid,
        or nothing is written (DuplicateId names the first id in use). `inputs` and `files` are
        sent once (content-addressed) and named by every member as its INPUTS."""
        from psycopg.types.json import Jsonb

        checked = [self._checked(task_id, task) for task_id, task in tasks]
        budget = max_tries if max_tries is not None else (INFRA.attempts or 1)
        uploads = [*([inputs] if inputs is not None else []), *files]
        for b in uploads:
            blobstore.check(b, task_id=tasks[0][0] if tasks else None)

        def one(conn: Any, again: bool, task_id: str, task: Task, doc: dict[str, Any]) -> Record:
            if task.group is not None:
                groups.check_joinable(conn, task_id, task.group)
            row = conn.execute(
                "INSERT INTO fila_tasks (id, state, task, engine, max_tries) "
                "VALUES (%s, 'queued', %s, %s, %s) ON CONFLICT (id) DO NOTHING RETURNING submitted_at",
                (task_id, Jsonb(doc), task.engine, budget),
            ).fetchone()
            if row is None:
                row = conn.execute("SELECT task FROM fila_tasks WHERE id = %s", (task_id,)).fetchone()
                if again and row is not None and row[0] == doc:  # our own insert, its commit cut off
                    return self._record(conn, task_id)
                raise DuplicateId(
                    f"task id {task_id!r} exists already in the queue database {self.where}",
                    task_id=task_id,
                    hint="choose another id, or omit it to get a new one; nothing of this submit was queued",
                )
            at = row[0]
            rec = records.transition(task_id, None, S.queued, at, task=task)
            data: dict[str, Any] = {"from": None, "to": "queued"}
            if inputs is not None:
                sent, size = blobstore.put_missing(conn, uploads)
                conn.execute(
                    "INSERT INTO fila_task_blobs (task_id, name, sha256, attempt) VALUES (%s, %s, %s, 0)",
                    (task_id, INPUTS, inputs.sha256),
                )
                data["inputs"] = {"blobs": len({b.sha256 for b in uploads}), "sent": sent, "bytes_sent": size}
            self._write(conn, task_id, rec, "submitted", data)
            if notify:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, task_id))
            return rec

        return self._tx(lambda conn, again: [one(conn, again, t, task, doc) for t, task, doc in checked])

    def _checked(self, task_id: str, task: Task) -> tuple[str, Task, dict[str, Any]]:
        """The task as stored (id set, validated again) and its JSON document; nothing written."""
        if not valid_id(task_id):
            from ...core.errors import InvalidId

            raise InvalidId(f"task id {task_id!r} is not [A-Za-z0-9._-]{{1,128}}")
        task = task.model_copy(update={"id": task_id})
        doc = task.model_dump(mode="json", exclude_none=True)
        try:  # again: a Task built without validation (model_construct) is not stored as valid
            task = Task.model_validate(doc)
        except ValidationError as e:
            raise InvalidInput(f"task {task_id} does not validate: {e}", task_id=task_id) from None
        if not valid_id(task.engine):  # the engine names a claimable set (and an index entry)
            raise InvalidInput(
                f"task {task_id}: engine name {task.engine[:80]!r} is not [A-Za-z0-9._-]{{1,128}}",
                task_id=task_id,
            )
        return task_id, task, doc

    def _give_up_row(self, conn: Any, task_id: str, why: str) -> None:
        """A running task whose lease lapsed and whose record does not read: its row to
        needs_human (a new token fences its runner off), an event saying why; the record is left
        for a person."""
        conn.execute(
            "UPDATE fila_tasks SET state = 'needs_human', runner = NULL, claim_nonce = NULL, "
            "token = nextval('fila_token_seq'), lease_expires_at = NULL, updated_at = now() WHERE id = %s",
            (task_id,),
        )
        self._event(conn, task_id, "lease lost", {"from": "running", "to": "needs_human", "why": why[:400]})

    def sweep(self, *, policy: RetryPolicy = INFRA, limit: int = 100) -> list[tuple[str, Status]]:
        """Decide the tasks whose lease expired on the database's clock (rows other sweepers hold
        are skipped): requeued with a new token while the container had not started and the retry
        budget allows (backoff from `policy`), otherwise needs_human. (task id, new status) each.

        Each row is decided in its own savepoint. A row whose decision cannot be written (its
        record, changed outside fila, does not read or does not allow it) goes to needs_human in
        the row alone, with a new token and an event saying why, and is logged as an error: its
        record is left for a person, and the row is neither run again nor swept again ahead of
        every other expired lease."""
        import psycopg

        def run(conn: Any, _again: bool) -> list[tuple[str, Status]]:
            rows = conn.execute(
                "SELECT id, runner, started, tries, max_tries, lease_expires_at, now() FROM fila_tasks "
                "WHERE state = 'running' AND lease_expires_at <= now() "
                "ORDER BY lease_expires_at LIMIT %s FOR UPDATE SKIP LOCKED",
                (limit,),
            ).fetchall()
            out = []
            for row in rows:
                try:
                    with conn.transaction():
                        out.append((row[0], self._sweep_one(conn, row, policy)))
                except (FilaError, ValidationError, psycopg.Error) as e:
                    if isinstance(e, psycopg.Error) and retryable(e):
                        raise
                    # Its record cannot say so: the row alone goes to a person, so that it is
                    # neither swept again ahead of every other expired lease nor run again.
                    log.error("sweep: task %s (lease lapsed) to needs_human, its record left: %s", row[0], e)
                    with conn.transaction():
                        self._give_up_row(
                            conn, row[0], f"its lease lapsed and its record cannot be read: {e}"
                        )
                    out.append((row[0], S.needs_human))
            return out

        return self._tx(run)

    def _sweep_one(self, conn: Any, row: tuple[Any, ...], policy: RetryPolicy) -> Status:
        """One expired lease decided (see sweep): the status it is left in."""
        tid, runner, started, tries, budget, expired, at = row
        cur = self._record(conn, tid)
        lapsed = f"runner {runner}'s lease expired at {records.iso(expired)}"
        if not started and not RetryPolicy(budget, 0, 0).gives_up(tries + 1):
            until = at + seconds(policy.backoff(tries + 1))
            err = ErrorInfo(kind=ErrorKind.infra, message=f"{lapsed} before its container started")
            changes = {"error": err, "not_before": until.timestamp()}
            self._settle(conn, tid, cur, S.queued, at, tries + 1, "lost", changes, not_before=until)
            return S.queued
        if started:
            what = f"{lapsed} while its container ran"
            err = ErrorInfo(kind=ErrorKind.interrupted, message=what)
        else:
            what = f"{lapsed} before its container started, and its {budget} tries are spent"
            err = ErrorInfo(kind=ErrorKind.infra, message=what)
        diagnosis = (
            f"{what[0].upper()}{what[1:]} (attempt {cur.attempt}). Nothing was run again: "
            f"`fila retry {tid}` runs it from a clean copy, `fila reject {tid}` drops it."
        )
        changes = {"error": err, "diagnosis": diagnosis}
        self._settle(conn, tid, cur, S.needs_human, at, tries, "lost", changes)
        return S.needs_human

    def retry(self, task_id: str, *, by: str, reason: str | None = None) -> Record:
        """A person's requeue of a task that failed or needs a human (a new token)."""

        def run(conn: Any, again: bool) -> Record:
            row = conn.execute(
                "SELECT tries, now() FROM fila_tasks WHERE id = %s FOR UPDATE", (task_id,)
            ).fetchone()
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            cur = self._record(conn, task_id)
            done = cur.decision
            if again and cur.status == S.queued and done and (done.action, done.by) == ("retried", by):
                return cur  # our retry, its commit cut off
            decision = Decision(action="retried", by=by, at=records.iso(row[1]), reason=reason)
            rec = records.transition(
                task_id,
                cur,
                S.queued,
                row[1],
                expect={S.needs_human, S.failed},
                changes={"decision": decision},
            )
            self._move(conn, task_id, S.queued, row[0], None)
            data = {"from": str(cur.status), "to": "queued", "by": by, "reason": reason}
            self._write(conn, task_id, rec, "retried", data)
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, task_id))
            return rec

        return self._tx(run)

    def decide(self, task_id: str, to: Status, decision: Decision, *, expect: set[Status]) -> Record:
        """A person's final decision (applied or rejected), recorded once for everyone: refused
        (InvalidTransition) unless the task is in `expect` (review/decision.py's DECIDABLE), so a
        second decision, from any host, changes nothing. `applied` of a compare group's member is
        refused: it goes through decide_group, which supersedes the other members in the same
        transaction (one transaction: the row lock, the check, the record, the event)."""
        if to not in (S.applied, S.rejected):
            raise InvalidTransition(f"a decision makes a task applied or rejected, not {to}", task_id=task_id)

        def run(conn: Any, _again: bool) -> Record:
            row = conn.execute("SELECT now(), task->>'group' FROM fila_tasks WHERE id = %s FOR UPDATE",
                               (task_id,)).fetchone()  # fmt: skip
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            if to == S.applied and row[1] is not None:
                raise InvalidTransition(
                    f"task {task_id} is a member of group {row[1]!r}: its apply is decided with the "
                    "supersedes of the other members (PgQueue.decide_group), not alone",
                    task_id=task_id,
                )
            cur = self._record(conn, task_id)
            if cur.status == to and cur.decision == decision:
                return cur  # this decision, recorded already (its reply lost): the same answer
            rec = records.transition(task_id, cur, to, row[0], expect=expect, changes={"decision": decision})
            conn.execute(
                "UPDATE fila_tasks SET state = %s, updated_at = now() WHERE id = %s", (str(to), task_id)
            )
            data = {"from": str(cur.status), "to": str(to), "by": decision.by, "reason": decision.reason}
            self._write(conn, task_id, rec, "decided", data)
            return rec

        return self._tx(run)

    # -- runners --------------------------------------------------------------------------------

    def note(self, task_id: str, event: str, data: dict[str, Any]) -> None:
        """An event in the task's log that changes nothing else (a reviewer's `apply started`)."""

        def run(conn: Any, _again: bool) -> None:
            if conn.execute("SELECT 1 FROM fila_tasks WHERE id = %s", (task_id,)).fetchone() is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            self._event(conn, task_id, event, data)

        self._tx(run)
