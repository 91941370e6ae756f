"""The PostgreSQL queue's connections and reads (docs/architecture.md, "The PostgreSQL queue").

A `Database` holds a psycopg pool for one queue URL, checked at open (a clear error for a wrong
URL, credentials or schema version). Each operation is one transaction, run again (up to
`reconnect_s`) when the connection breaks (a restart, a killed server), so every operation must be
safe to repeat: `again` tells it that an earlier try may have committed. Other database errors
are not retried: they would fail the same way again. LISTEN/NOTIFY wakes
waiting runners early; it is a hint only, never the guarantee (see `wait_for_work`).

Every writer (store.py) locks the task's row first, then writes its record and events through
`_write` in the same transaction, so the four tables always agree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Self, TypeVar

from ...core.errors import InvalidInput, InvalidTransition, NotFound, Refused, TimedOut
from ...core.models import Record, Status
from . import blobs as blobstore
from . import conninfo, migrate, records
from .errors import QueueFailed, QueueUnreachable

S = Status
T = TypeVar("T")
CHANNEL = "fila_queued"  # NOTIFY payload: the task id (a hint only; the poll is the guarantee)
# NOTIFY payload: the task id of a record that left queued and running (an outcome, a decision);
# a hint for `wait_settled`, which polls all the same.
SETTLED = "fila_settled"


# SQLSTATEs after which the same transaction may succeed on another try: the server went away
# (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now), a serialization
# failure, a deadlock. Class 08 (connection exceptions) is matched by its prefix.
RETRY_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "40001", "40P01"})


def retryable(err: BaseException) -> bool:
    """Whether a failed transaction is worth running again: its connection broke (or none came
    within the wait), or the server answered with one of RETRY_SQLSTATES or class 08."""
    import psycopg

    # A PoolTimeout only where the pool is in use (not imported, no error of it can exist).
    pool = sys.modules.get("psycopg_pool")
    if pool is not None and isinstance(err, pool.PoolTimeout):
        return True
    if not isinstance(err, psycopg.Error):
        return False
    state = err.sqlstate
    if state is not None:
        return state.startswith("08") or state in RETRY_SQLSTATES
    # No SQLSTATE: the client's side of a broken connection (closed socket, lost server).
    return isinstance(err, psycopg.OperationalError)


class Database:
    """One queue database, shared by this process's threads (a pool of `max_size` connections,
    or with `single` one connection: queue/pg/oneconn.py)."""

    def __init__(
        self,
        url: str,
        *,
        max_size: int = 4,
        reconnect_s: float = 30.0,
        io_timeout_s: float | None = None,
        single: bool = False,
    ) -> None:
        """`io_timeout_s` (a runner's connections): no statement runs longer on the server
        (statement_timeout), and over TCP a peer that stops acknowledging or answering keepalives
        breaks the connection within about that long (tcp_user_timeout, keepalives), so a call
        on a silently partitioned network returns with an error instead of blocking for ever.
        `single`: one connection and no pool (a process that makes one call at a time: `fila
        submit --queue`), without psycopg_pool's import."""
        self.params = conninfo.parse(url)
        self.where = conninfo.describe(self.params)
        self.url = url
        self.reconnect_s = reconnect_s
        with conninfo.connect(url) as conn:  # a clear error for a wrong URL, credentials or schema
            migrate.check(conn, self.where)
        kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 10}
        configure = None
        if io_timeout_s is not None:
            ms = max(1000, int(io_timeout_s * 1000))
            idle = max(1, int(io_timeout_s / 3))
            kwargs.update(tcp_user_timeout=ms, keepalives=1, keepalives_idle=idle,
                          keepalives_interval=idle, keepalives_count=3)  # fmt: skip

            def configure(conn: Any) -> None:  # a SET, not `options`: the URL's own options stay
                conn.execute(f"SET statement_timeout = {ms}")

        self._timeouts: tuple[type[BaseException], ...] = ()
        if single:
            from .oneconn import OneConnection

            self.pool: Any = OneConnection(url, kwargs, configure)
        else:
            from psycopg_pool import ConnectionPool, PoolTimeout

            self._timeouts = (PoolTimeout,)
            self.pool = ConnectionPool(
                url,
                min_size=1,
                max_size=max_size,
                open=False,
                kwargs=kwargs,
                configure=configure,
                name="fila-queue",
            )
            self.pool.open(wait=False)
        self._listener: Any = None

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one transaction, run again when the connection breaks --------------------------------

    def _tx(self, fn: Callable[[Any, bool], T]) -> T:
        """`fn(conn, again)` in one transaction; on a broken connection, a server going away, a
        serialization failure or deadlock, or no connection within the wait (`retryable`), it runs
        again, `again` True, until `reconnect_s` has passed. Any other database error (a full
        disk, a statement timeout, a value the schema refuses) is raised at once as QueueFailed."""
        import psycopg

        deadline = time.monotonic() + self.reconnect_s
        delay, again = 0.05, False
        while True:
            try:
                wait = max(0.1, deadline - time.monotonic())
                with self.pool.connection(timeout=wait) as conn, conn.transaction():
                    return fn(conn, again)
            except (psycopg.Error, *self._timeouts) as e:
                said = conninfo.mask(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                if not retryable(e):
                    raise QueueFailed(
                        f"the queue database {self.where} refused the operation: {said}",
                        hint="nothing of this operation was written; the database's log says more",
                    ) from None
                if time.monotonic() + delay > deadline:
                    raise QueueUnreachable(
                        f"the queue database {self.where} did not answer for {self.reconnect_s:g} s: {said}",
                        hint="check that PostgreSQL runs there (pg_isready); the last try may have "
                        "been applied before its reply was lost: look at the task's state before "
                        "repeating it",
                    ) from None
                time.sleep(delay)
                delay, again = min(1.0, delay * 2), True

    # -- reading --------------------------------------------------------------------------------

    def get(self, task_id: str) -> Record:
        """The task's record; NotFound for an unknown id."""
        return self._tx(lambda conn, _again: self._record(conn, task_id))

    def listing(self, status: Status | None = None) -> tuple[list[Record], list[tuple[str, str]]]:
        """The records (of one status, or all), oldest submitted first, and (id, what is wrong) of
        each record that does not read (changed outside fila): one bad row hides no other."""
        sql = "SELECT t.id, r.record::text FROM fila_tasks t LEFT JOIN fila_records r USING (id)"
        sql += " WHERE t.state = %s" if status is not None else ""
        sql += " ORDER BY t.submitted_at, t.id"
        args = (str(status),) if status is not None else ()
        rows = self._tx(lambda conn, _again: conn.execute(sql, args).fetchall())
        recs, bad = [], []
        for tid, text in rows:
            if text is None:
                bad.append((tid, "its record row is missing"))
                continue
            try:
                recs.append(records.read_record(tid, text, self.where))
            except Refused as e:
                bad.append((tid, e.message))
        return recs, bad

    def events(self, task_id: str) -> list[dict[str, Any]]:
        """The task's events in order, each {"at", "event", ...data} like events.jsonl's lines."""
        rows = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT at, event, data::text FROM fila_events WHERE task_id = %s ORDER BY seq", (task_id,)
            ).fetchall()
        )
        return [records.event_line(records.iso(at), ev, text) for at, ev, text in rows]

    def task_state(self, task_id: str) -> dict[str, Any]:
        """The task's queue columns (state, runner, token, attempt, tries, started, lease...)."""

        def run(conn: Any, _again: bool) -> dict[str, Any]:
            cur = conn.execute(
                "SELECT id, state, engine, attempt, tries, max_tries, runner, token, started, "
                "lease_expires_at, not_before FROM fila_tasks WHERE id = %s",
                (task_id,),
            )
            row = cur.fetchone()
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            return dict(zip([d.name for d in cur.description], row, strict=True))

        return self._tx(run)

    def counts(self) -> dict[str, dict[str, int]]:
        """Tasks by status, then by engine: {"queued": {"shell": 3}, ...} (for `fila status`)."""
        rows = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT state, engine, count(*) FROM fila_tasks GROUP BY state, engine"
            ).fetchall()
        )
        out: dict[str, dict[str, int]] = {}
        for state, engine, n in rows:
            out.setdefault(state, {})[engine] = n
        return out

    def runners(self, live_s: float) -> list[dict[str, Any]]:
        """The runners the queue knows, each with `live`: not stopped and seen within `live_s`
        seconds on the database's clock; `seen_s` ago on that clock too; `policies` the ones it
        takes (None: any)."""
        rows = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT id, array_to_json(engines)::text, array_to_json(policies)::text, images::text, "
                "slots, started_at, seen_at, stopped_at, "
                "extract(epoch FROM now() - seen_at), "
                "stopped_at IS NULL AND seen_at > now() - make_interval(secs => %s) "
                "FROM fila_runners ORDER BY id",
                (live_s,),
            ).fetchall()
        )
        keys = ("id", "engines", "policies", "images", "slots", "started_at", "seen_at", "stopped_at",
                "seen_s", "live")  # fmt: skip
        out = [dict(zip(keys, r, strict=True)) for r in rows]
        for r in out:
            r["seen_s"] = float(r["seen_s"])
            try:  # read as untrusted: a row changed outside fila says so, it stops no `fila status`
                r["images"] = records.json_text(r["images"] or "{}", kind="runner images")
            except InvalidInput as e:
                r["images"] = {"unreadable": e.message}
            for k in ("engines", "policies"):  # names only: a NULL or a nested array is left out
                if r[k] is not None:
                    try:
                        got = records.json_text(r[k], kind=f"runner {k}")
                    except InvalidInput:
                        got = []
                    r[k] = [x for x in got if isinstance(x, str)] if isinstance(got, list) else []
            for k in ("started_at", "seen_at", "stopped_at"):
                r[k] = records.iso(r[k]) if r[k] is not None else None
        return out

    def queued(self) -> list[tuple[str, str, str]]:
        """(task id, engine, policy) of every queued task, oldest first."""
        return self._tx(
            lambda conn, _again: conn.execute(
                "SELECT id, engine, coalesce(task->>'policy', 'default') FROM fila_tasks "
                "WHERE state = 'queued' ORDER BY submitted_at, id"
            ).fetchall()
        )

    def task_blobs(self, task_id: str) -> dict[str, str]:
        """name -> sha256 of the blobs the task's publish named."""
        rows = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT name, sha256 FROM fila_task_blobs WHERE task_id = %s ORDER BY name", (task_id,)
            ).fetchall()
        )
        return dict(rows)

    def blob(self, sha256: str) -> bytes:
        """The blob's bytes, checked against its sha256 (BlobMismatch); NotFound when absent."""
        data = self._tx(lambda conn, _again: blobstore.read(conn, sha256))
        if data is None:
            raise NotFound(f"no blob sha256 {sha256} in the queue database {self.where}")
        return data

    def clock(self) -> datetime:
        """The database's now(): the one clock leases are judged by."""
        return self._tx(lambda conn, _again: conn.execute("SELECT now()").fetchone()[0])

    # -- wake-ups -------------------------------------------------------------------------------

    def _listen(self) -> None:
        """Open the LISTEN connection when there is none (a broken one is dropped by wait)."""
        if self._listener is not None:
            return
        import psycopg

        conn = None
        try:
            conn = conninfo.connect(self.url, autocommit=True, timeout=5)
            conn.execute(f"LISTEN {CHANNEL}")
            self._listener = conn
        except (psycopg.Error, QueueUnreachable):
            if conn is not None:  # connected, but LISTEN failed: not kept, so closed here
                conn.close()
            self._listener = None

    def wait_for_work(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a NOTIFY that a task was queued: True when one came.
        A hint only: notifications are lost on reconnect and through poolers, so callers poll
        at least every `timeout` seconds whatever this returns. One thread at a time waits on a
        Database (its LISTEN connection is its own); give each waiting thread its own Database."""
        import psycopg

        self._listen()
        if self._listener is None:
            time.sleep(timeout)
            return False
        try:
            for _ in self._listener.notifies(timeout=timeout, stop_after=1):
                return True
            return False
        except psycopg.Error:
            self._listener.close()
            self._listener = None
            return False

    def wait_settled(self, task_id: str, *, poll_s: float = 0.5, timeout_s: float | None = None) -> Record:
        """The task's record once it is neither queued nor running (`submit --run`): woken by
        the NOTIFY its publish sends, and looked at every `poll_s` seconds whether or not one
        came (a notification is a hint: lost on reconnect and through poolers). TimedOut once
        `timeout_s` has passed (None: no bound)."""
        import psycopg

        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        listener = None
        try:
            try:  # before the first look: a publish after it wakes the wait
                listener = conninfo.connect(self.url, autocommit=True, timeout=5)
                listener.execute(f"LISTEN {SETTLED}")
            except (psycopg.Error, QueueUnreachable):
                if listener is not None:
                    listener.close()
                listener = None
            while True:
                rec = self.get(task_id)
                if rec.status not in (S.queued, S.running):
                    return rec
                row = self.task_state(task_id)["state"]
                if row not in (S.queued, S.running):  # the claim or the sweep left its record for a person
                    raise Refused(
                        f"task {task_id}: its row says {row}, its record {rec.status}: the record was "
                        "changed outside fila",
                        task_id=task_id,
                        hint=f"`fila logs {task_id} --events --queue URL` says why",
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimedOut(
                        f"task {task_id} is still {rec.status} after {timeout_s:g} s",
                        task_id=task_id,
                        hint="wait again, or look later: the task goes on without the wait",
                    )
                wait = poll_s if deadline is None else max(0.01, min(poll_s, deadline - time.monotonic()))
                if listener is None:
                    time.sleep(wait)
                    continue
                try:
                    for n in listener.notifies(timeout=wait):
                        if n.payload == task_id:
                            break
                except psycopg.Error:
                    listener.close()
                    listener = None
        finally:
            if listener is not None:
                listener.close()

    # -- inside a transaction -------------------------------------------------------------------

    def _record(self, conn: Any, task_id: str) -> Record:
        row = conn.execute("SELECT record::text FROM fila_records WHERE id = %s", (task_id,)).fetchone()
        if row is None:
            raise NotFound(
                f"no task {task_id!r} in the queue database {self.where}", hint="`fila ls` lists tasks"
            )
        return records.read_record(task_id, row[0], self.where)

    def _event(self, conn: Any, task_id: str, event: str, data: dict[str, Any]) -> None:
        from psycopg.types.json import Jsonb

        conn.execute(
            "INSERT INTO fila_events (task_id, event, data) VALUES (%s, %s, %s)",
            (task_id, event, Jsonb(data)),
        )

    def _write(self, conn: Any, task_id: str, rec: Record, event: str, data: dict[str, Any]) -> None:
        """Upsert task `task_id`'s record and append its event (the caller holds the task's row).
        A record that names another task is refused (the schema refuses it too)."""
        from psycopg.types.json import Jsonb

        if rec.id != task_id:
            raise InvalidTransition(
                f"refused to write a record of task {rec.id!r} as task {task_id}'s", task_id=task_id
            )
        if rec.error is not None and rec.status in (S.failed, S.needs_human, S.queued):
            data = {**data, "error": rec.error.model_dump(mode="json")}
        conn.execute(
            "WITH r AS (INSERT INTO fila_records (id, record) VALUES (%(id)s, %(rec)s) "
            "ON CONFLICT (id) DO UPDATE SET record = excluded.record, updated_at = now()) "
            "INSERT INTO fila_events (task_id, event, data) VALUES (%(id)s, %(event)s, %(data)s)",
            {"id": task_id, "rec": Jsonb(rec.model_dump(mode="json")), "event": event, "data": Jsonb(data)},
        )
        if rec.status not in (S.queued, S.running):
            conn.execute("SELECT pg_notify(%s, %s)", (SETTLED, task_id))

    def _move(self, conn: Any, task_id: str, to: Status, tries: int, not_before: datetime | None) -> None:
        """The row's side of an owner change: a new token; queued clears the run's columns."""
        conn.execute(
            "UPDATE fila_tasks SET state = %(to)s, token = nextval('fila_token_seq'), tries = %(tries)s, "
            "runner = CASE WHEN %(queued)s THEN NULL ELSE runner END, "
            "started = started AND NOT %(queued)s, not_before = %(not_before)s, "
            "lease_expires_at = NULL, updated_at = now() WHERE id = %(id)s",
            {
                "to": str(to),
                "tries": tries,
                "queued": to == S.queued,
                "not_before": not_before,
                "id": task_id,
            },
        )
