"""The runner's side of the PostgreSQL queue (store.py's PgQueue holds it): claim, renew, the
started mark and checkpoints, publish and hand back, each fenced by the claim's token
(docs/architecture.md, "The PostgreSQL queue"; the rules are "The queue's contract").

Fencing: a claim draws a token from `fila_token_seq`; so does every later change of owner (a
requeue, a sweep's decision, a person's retry). Renew, checkpoints, the started mark, hand back
and publish change a row only `WHERE id = $id AND token = $token AND state = 'running' AND
lease_expires_at > now()`: a runner whose lease expired (on the database's clock, whether or not
a sweep has run yet) or was taken changes nothing (LeaseLost, or publish's None). Publish keeps
the token, so a publish whose commit was cut off is recognised when it is sent again (the row left
`running` with that same token).

The side-effect boundary: the runner marks the task started (`mark_started`) *before* it starts
its container. A lease that expires before the mark is requeued with a new token while the task's
retry budget (`max_tries`) allows; after the mark, or with the budget spent, it goes to
`needs_human`, never silently run again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from ...core.errors import (
    InvalidInput,
    InvalidTaskFile,
    InvalidTransition,
    NotFound,
    Refused,
)
from ...core.models import Attempt, ErrorInfo, ErrorKind, Record, Status, Task
from ..retry import RetryPolicy
from ..store import LeaseLost
from . import blobs as blobstore
from . import breaker, records
from .blobs import Blob
from .db import CHANNEL, Database

S = Status
log = logging.getLogger(__name__)
OUTCOMES = {S.needs_review, S.failed, S.needs_human}
# The queued tasks a runner of %(engines)s and %(policies)s (None: any policy) can take: what the
# claim chooses from (once a task's backoff is over and the breaker closed) and what `backoff_left`
# waits for, one text so that they never disagree (a `--once` runner would wait on a task its
# claim never takes).
CLAIMABLE = (
    "state = 'queued' AND engine = ANY(%(engines)s) "
    "AND (%(policies)s::text[] IS NULL OR coalesce(task->>'policy', 'default') = ANY(%(policies)s))"
)
# The row a lease holds: its id, its token, still running, not expired on the database's clock.
HELD = "id = %s AND token = %s AND state = 'running' AND lease_expires_at > now()"


@dataclass(frozen=True)
class Lease:
    """A claim: the task, its attempt, and the fencing token every later write must carry."""

    task_id: str
    token: int
    runner: str
    attempt: int
    task: Task
    expires_at: datetime
    # The database's clock less this host's wall clock at the claim (to within the claim's round
    # trip): what turns the times this host writes into the database's in a publish. Never used
    # to judge the lease.
    clock_offset_s: float = 0.0


CLAIM_SQL = f"""
WITH pick AS (
    SELECT id FROM fila_tasks
    WHERE {CLAIMABLE} AND (not_before IS NULL OR not_before <= now()) AND {breaker.CLOSED}
    ORDER BY submitted_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE fila_tasks t
SET state = 'running', runner = %(runner)s, token = nextval('fila_token_seq'), claim_nonce = %(nonce)s,
    lease_expires_at = now() + %(ttl)s, attempt = t.attempt + 1, started = false,
    not_before = NULL, claimed_at = now(), updated_at = now()
FROM pick WHERE t.id = pick.id
RETURNING t.id, t.token, t.attempt, t.task::text, t.lease_expires_at, now(),
    (SELECT record::text FROM fila_records r WHERE r.id = t.id), t.engine
"""


def runner_of(rec: Record) -> str:
    return rec.worker or "unknown"


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


class PgLeases(Database):
    """Claims and what a lease allows its holder (PgQueue's part for runners)."""

    # -- claim and lease ------------------------------------------------------------------------

    def claim(
        self, runner: str, engines: Iterable[str], ttl: float, *, policies: Iterable[str] | None = None
    ) -> Lease | None:
        """The oldest queued task this runner can run (its engine is in `engines`, its policy in
        `policies` unless that is None, its backoff over), claimed in one statement that skips
        rows other runners hold: running, this runner's, a new token, a lease of `ttl` seconds
        on the database's clock. None: no task.

        The call's random nonce is stored with the claim: when the commit's reply was lost and
        the transaction runs again, the task this call claimed is found by it and its lease
        returned, never a second task claimed. A task whose stored document no longer validates
        fails (queued -> failed, the reason in its error) and the next one is claimed."""
        engines = sorted(set(engines))
        pols = sorted(set(policies)) if policies is not None else None
        nonce = secrets.token_hex(16)
        claimed_at: list[datetime] = []  # the database's clock at the claim that holds

        def run(conn: Any, again: bool) -> Lease | None:
            if again:
                row = conn.execute(
                    "SELECT id, token, attempt, task::text, lease_expires_at, claimed_at FROM fila_tasks "
                    "WHERE state = 'running' AND runner = %s AND claim_nonce = %s",
                    (runner, nonce),
                ).fetchone()
                if row is not None:  # this call's claim, its commit's reply lost
                    tid, token, attempt, doc, expires, at = row
                    claimed_at[:] = [at]
                    return Lease(tid, token, runner, attempt, records.read_task(doc), expires)
            while True:
                row = conn.execute(
                    CLAIM_SQL,
                    {
                        "engines": engines,
                        "policies": pols,
                        "runner": runner,
                        "ttl": seconds(ttl),
                        "nonce": nonce,
                    },
                ).fetchone()
                if row is None:
                    return None
                tid, token, attempt, doc, expires, at, text, engine = row
                # Any row a credential holder changed fails its own task, in this transaction; the
                # claim goes on to the next (docs/scale-out.md: one bad row hides no other).
                try:
                    cur = records.read_record(tid, text or "null", self.where)
                except Refused as e:
                    self._refuse_unreadable(conn, tid, e.message)
                    continue
                if cur.status != S.queued:
                    self._refuse_unreadable(
                        conn, tid, f"task {tid}: its record says {cur.status}, its row queued"
                    )
                    continue
                try:
                    task = records.read_task(doc)
                    if task.engine != engine:
                        raise InvalidTaskFile(
                            f"its document names engine {task.engine!r}, its row {engine!r}"
                        )
                except (ValidationError, InvalidInput) as e:
                    self._refuse_claimed(conn, tid, cur, at, e)
                    continue
                try:
                    rec = records.started(tid, cur, at, runner=runner, engine=task.engine, attempt=attempt)
                except (InvalidTransition, ValidationError) as e:  # a record fila cannot move on
                    self._refuse_unreadable(conn, tid, f"task {tid}: its record cannot be claimed: {e}")
                    continue
                data = {"from": "queued", "to": "running", "runner": runner, "token": token}
                self._write(conn, tid, rec, "claimed", {**data, "attempt": attempt})
                claimed_at[:] = [at]
                return Lease(tid, token, runner, attempt, task, expires)

        sent = time.time()
        lease = self._tx(run)
        if lease is None or not claimed_at:
            return lease
        here = (sent + time.time()) / 2  # this host's wall clock halfway through the call
        return replace(lease, clock_offset_s=claimed_at[0].timestamp() - here)

    def _refuse_claimed(
        self, conn: Any, task_id: str, cur: Record, at: datetime, err: ValidationError | InvalidInput
    ) -> None:
        """A just-claimed task whose stored document does not read or validate (queued by an older
        fila, or changed in the database): failed, in the claim's transaction, with the first
        problem."""
        rec = records.invalid(task_id, cur, at, err)
        conn.execute(
            "UPDATE fila_tasks SET state = 'failed', runner = NULL, claim_nonce = NULL, "
            "lease_expires_at = NULL, attempt = attempt - 1, updated_at = now() WHERE id = %s",
            (task_id,),
        )
        self._write(conn, task_id, rec, "rejected", {"from": "queued", "to": "failed"})

    def _refuse_unreadable(self, conn: Any, task_id: str, why: str) -> None:
        """A just-claimed task whose record does not read, or disagrees with its row (changed in
        the database): its row failed and an event saying why, in the claim's transaction; the
        record is left as it is, for a person (`fila show` names what is wrong with it)."""
        conn.execute(
            "UPDATE fila_tasks SET state = 'failed', runner = NULL, claim_nonce = NULL, "
            "lease_expires_at = NULL, attempt = attempt - 1, updated_at = now() WHERE id = %s",
            (task_id,),
        )
        self._event(conn, task_id, "rejected", {"from": "queued", "to": "failed", "why": why[:400]})

    def claim_wait(
        self,
        runner: str,
        engines: Iterable[str],
        ttl: float,
        *,
        poll_s: float,
        timeout: float,
        policies: Iterable[str] | None = None,
    ) -> Lease | None:
        """`claim`, waiting up to `timeout` seconds for a task: woken early by a NOTIFY, and at the
        latest every `poll_s` seconds whether or not a notification arrived."""
        engines = list(engines)
        end = time.monotonic() + timeout
        while True:
            self._listen()  # before the claim: a task queued after it empties the wait at once
            lease = self.claim(runner, engines, ttl, policies=policies)
            left = end - time.monotonic()
            if lease is not None or left <= 0:
                return lease
            self.wait_for_work(min(poll_s, left))

    def backoff_left(self, engines: Iterable[str], *, policies: Iterable[str] | None = None) -> float | None:
        """Seconds (on the database's clock) until the first queued task a runner of `engines`
        (and `policies`, unless None) could claim ends its backoff: 0 when one is claimable now,
        None when no such task is queued (`fila worker --queue --once` waits for it, as `fila run
        --once` waits for a backoff on the file queue)."""
        pols = sorted(set(policies)) if policies is not None else None
        row = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT extract(epoch FROM min(coalesce(not_before, now())) - now()) FROM fila_tasks "
                f"WHERE {CLAIMABLE}",
                {"engines": sorted(set(engines)), "policies": pols},
            ).fetchone()
        )
        return None if row is None or row[0] is None else max(0.0, float(row[0]))

    def renew(self, task_id: str, token: int, ttl: float) -> datetime:
        """Extend the lease to now() + `ttl` on the database's clock; LeaseLost when the task is
        no longer this token's (swept, retried, published)."""

        def run(conn: Any, _again: bool) -> datetime:
            row = conn.execute(
                "UPDATE fila_tasks SET lease_expires_at = now() + %s "
                f"WHERE {HELD} RETURNING lease_expires_at",
                (seconds(ttl), task_id, token),
            ).fetchone()
            if row is None:
                raise LeaseLost(f"task {task_id}: token {token} no longer holds its lease")
            return row[0]

        return self._tx(run)

    def mark_started(self, task_id: str, token: int, *, container: str) -> Record:
        """Record that the task's container is about to start (the side-effect boundary): from
        now on a lost lease sends the task to needs_human. LeaseLost when the token is stale."""
        return self._running_change(
            task_id,
            token,
            "started = true",
            {"container": container, "container_started": True},
            "container started",
            {"container": container, "token": token},
        )

    def checkpoint(self, task_id: str, token: int, *, event: str = "checkpoint", **fields: Any) -> Record:
        """running -> running with new fields of the record (the image, timings...), only while
        `token` holds the lease (LeaseLost otherwise)."""
        changes = records.result_fields(task_id, fields)
        return self._running_change(
            task_id, token, None, changes, event, {"token": token, "fields": sorted(fields)}
        )

    def _running_change(
        self,
        task_id: str,
        token: int,
        also_set: str | None,
        changes: dict[str, Any],
        event: str,
        log: dict[str, Any],
    ) -> Record:
        """running -> running with `changes` in the record (and `also_set` in the task's row),
        only while `token` holds the lease: LeaseLost otherwise."""
        sets = f"{also_set}, updated_at = now()" if also_set else "updated_at = now()"

        def run(conn: Any, _again: bool) -> Record:
            row = conn.execute(
                f"SELECT started, now() FROM fila_tasks WHERE {HELD} FOR UPDATE", (task_id, token)
            ).fetchone()
            if row is None:
                raise LeaseLost(f"task {task_id}: token {token} no longer holds its lease")
            cur = self._record(conn, task_id)
            if also_set and row[0] and all(getattr(cur, k) == v for k, v in changes.items()):
                return cur  # the started mark, made already (its reply lost): not logged twice
            conn.execute(f"UPDATE fila_tasks SET {sets} WHERE id = %s", (task_id,))
            rec = records.transition(task_id, cur, S.running, row[1], expect={S.running}, changes=changes)
            self._write(conn, task_id, rec, event, log)
            return rec

        return self._tx(run)

    # -- outcomes -------------------------------------------------------------------------------

    def publish(
        self,
        task_id: str,
        token: int,
        status: Status,
        fields: dict[str, Any],
        blobs: Iterable[Blob] = (),
        *,
        ran: list[Attempt] | None = None,
        threshold: int | None = None,
    ) -> Record | None:
        """The runner's outcome (needs_review, failed, needs_human) with its blobs, in one
        transaction, only while `token` holds the lease. A stale token writes nothing but a
        `result discarded` event and returns None. Every blob's sha256 is checked first
        (BlobMismatch: nothing written).

        `ran`: the engines this claim ran, in order (a fallback after the engine's quota adds
        one), as the runner saw them. They replace this claim's open attempt in the record; the
        queue's parts of each (its number, the claim it ran under, the runner) are the queue's,
        set here, and the earlier claims' attempts stay as they are.

        The outcome is counted by the queue's circuit breaker in the same transaction
        (pg/breaker.count; `threshold`: the task's policy's max_consecutive_failures as the runner
        has it, queue/breaker.threshold, else the default); a stale token's publish counts nothing."""
        if status not in OUTCOMES:
            raise InvalidTransition(f"publish takes an outcome ({', '.join(sorted(OUTCOMES))}), not {status}")
        changes = records.result_fields(task_id, fields)
        items = list(blobs)
        for b in items:
            blobstore.check(b, task_id=task_id)

        def run(conn: Any, _again: bool) -> Record | None:
            row = conn.execute(
                "SELECT state, token, attempt, now(), coalesce(lease_expires_at > now(), false) "
                "FROM fila_tasks WHERE id = %s FOR UPDATE",
                (task_id,),
            ).fetchone()
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            state, cur_token, attempt, at, live = row
            if cur_token == token and state != S.running:
                # Only a publish keeps the token while the task leaves running: this one's, sent
                # again after its reply was lost (within this call or by the caller).
                return self._record(conn, task_id)
            if state != S.running or cur_token != token or not live:
                why = "lease expired" if state == S.running and cur_token == token else "lease lost"
                self._event(
                    conn,
                    task_id,
                    "result discarded",
                    {"reason": why, "token": token, "current_token": cur_token, "state": state},
                )
                return None
            blobstore.put(conn, task_id, attempt, items)
            cur = self._record(conn, task_id)
            now = changes
            if ran:
                now = {**changes, "attempts": records.this_claim(cur, ran, attempt, runner_of(cur), at)}
            rec = records.transition(task_id, cur, status, at, expect={S.running}, changes=now)
            conn.execute(
                "UPDATE fila_tasks SET state = %s, lease_expires_at = NULL, updated_at = now() WHERE id = %s",
                (str(status), task_id),
            )
            self._write(
                conn,
                task_id,
                rec,
                "published",
                {
                    "from": "running",
                    "to": str(status),
                    "token": token,
                    "blobs": {b.name: b.sha256 for b in items},
                },
            )
            breaker.count(conn, rec, runner=runner_of(cur), threshold=threshold, at=at)
            return rec

        return self._tx(run)

    def hand_back(
        self,
        task_id: str,
        token: int,
        error: ErrorInfo | None,
        *,
        backoff_s: float = 0.0,
        counted: bool = True,
        threshold: int | None = None,
    ) -> Record | None:
        """A claimed task whose container never started goes back to the queue (a new token, a
        backoff); a counted hand back spends one try of the budget, and the last one fails the task
        instead. None when the token is stale. Refused (InvalidTransition) once the task is marked
        started: that task is for a person.

        A task that fails so is counted by the circuit breaker as `publish` counts a failure
        (`threshold`: the task's policy's max_consecutive_failures as the runner has it, else the
        default), as the file queue counts it."""

        def run(conn: Any, _again: bool) -> Record | None:
            row = conn.execute(
                f"SELECT started, tries, max_tries, now() FROM fila_tasks WHERE {HELD} FOR UPDATE",
                (task_id, token),
            ).fetchone()
            if row is None:
                return None
            started, tries, budget, at = row
            if started:
                raise InvalidTransition(
                    f"task {task_id}: its container started; it cannot be requeued silently", task_id=task_id
                )
            tries += 1 if counted else 0
            cur = self._record(conn, task_id)
            outcome = "requeued" if counted else "handed back"
            if not counted:
                cur = records.without_repeated_hand_back(cur)
            if counted and RetryPolicy(budget, 0, 0).gives_up(tries):
                msg = f"{error.message if error else 'handed back'} (gave up after {tries} attempts)"
                err = ErrorInfo(kind=error.kind if error else ErrorKind.infra, message=msg)
                rec = self._settle(conn, task_id, cur, S.failed, at, tries, outcome, {"error": err})
                breaker.count(conn, rec, runner=runner_of(cur), threshold=threshold, at=at)
                return rec
            until = at + seconds(backoff_s)
            changes = {"error": error, "not_before": until.timestamp() if backoff_s > 0 else None}
            return self._settle(conn, task_id, cur, S.queued, at, tries, outcome, changes, not_before=until)

        return self._tx(run)

    def _settle(
        self,
        conn: Any,
        task_id: str,
        cur: Record,
        to: Status,
        at: datetime,
        tries: int,
        outcome: str,
        changes: dict[str, Any],
        *,
        not_before: datetime | None = None,
    ) -> Record:
        """running -> queued, failed or needs_human for a lost or handed-back claim."""
        rec = records.transition(task_id, cur, to, at, expect={S.running}, outcome=outcome, changes=changes)
        self._move(conn, task_id, to, tries, not_before if to == S.queued else None)
        self._write(
            conn,
            task_id,
            rec,
            "requeued" if to == S.queued else "lease lost",
            {"from": "running", "to": str(to), "tries": tries, "outcome": outcome},
        )
        if to == S.queued:
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, task_id))
        return rec
