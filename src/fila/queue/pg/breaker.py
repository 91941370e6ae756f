"""The PostgreSQL queue's circuit breaker: one per queue database, shared by every runner on every
host (docs/scale-out.md, "The circuit breaker across hosts"; the rules are the file queue's,
docs/architecture.md "The queue's contract").

The state is the single row of `fila_breaker` (migration 0005), the file queue's BreakerState in
columns; its trips and rearms go to the append-only `fila_breaker_events`. What counts, and how,
is queue/breaker.py's `step`, applied here to the record a publish writes, in the publish's
own transaction (`count`): an outcome is counted exactly when it is written, and a publish
refused for a stale token counts nothing. The threshold is the failing task's policy's
`max_consecutive_failures` as its runner has it (published with the outcome), else the default.

While the breaker is open the claim statement (leases.CLAIM_SQL, through CLOSED) claims nothing:
the database refuses, not the runner's own check. A claim already in flight when the breaker trips
may still commit, as a file-queue worker's claim between its check and another worker's trip does.
Nothing reopens it but a person: `fila rearm --queue URL` (`rearm`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ...core.models import Record
from ..breaker import DEFAULT_THRESHOLD, RECENT, BreakerState, step, trip_data, verdict
from .db import Database
from .records import event_line, iso

# The claim statement's condition: no claim while the breaker is open.
CLOSED = "NOT EXISTS (SELECT 1 FROM fila_breaker WHERE open)"
COLUMNS = (
    "open, consecutive, threshold, recent, tripped_at, tripped_by, reason, rearmed_at, rearmed_by, updated_at"
)
FIELDS = [c.strip() for c in COLUMNS.split(",")]


def _iso(value: Any) -> Any:
    """A timestamp column as the records write it (records.iso: UTC, milliseconds)."""
    return iso(value) if isinstance(value, datetime) else value


def _state(row: tuple[Any, ...] | None) -> BreakerState:
    if row is None:  # the row removed by hand: a closed breaker, as on a file queue with no file
        return BreakerState()
    data = {k: _iso(v) for k, v in zip(FIELDS, row, strict=True)}
    data["recent"] = [x for x in data["recent"] or [] if isinstance(x, str)][-RECENT:]
    try:
        return BreakerState.model_validate(data)
    except ValidationError as e:  # the row changed outside fila: read as open, which claims nothing
        why = f"the breaker's row does not read ({e.errors()[0]['loc'] if e.errors() else e}); rearm it"
        return BreakerState(open=True, reason=why)


def _locked(conn: Any) -> BreakerState:
    """The breaker's row, locked until `conn`'s transaction ends (made again if it was removed)."""
    row = conn.execute(f"SELECT {COLUMNS} FROM fila_breaker FOR UPDATE").fetchone()
    if row is None:
        conn.execute("INSERT INTO fila_breaker DEFAULT VALUES ON CONFLICT DO NOTHING")
        row = conn.execute(f"SELECT {COLUMNS} FROM fila_breaker FOR UPDATE").fetchone()
    return _state(row)


def _save(conn: Any, st: BreakerState) -> None:
    conn.execute(
        "UPDATE fila_breaker SET open = %s, consecutive = %s, threshold = %s, recent = %s, "
        "tripped_at = %s, tripped_by = %s, reason = %s, rearmed_at = %s, rearmed_by = %s, updated_at = now()",
        (st.open, st.consecutive, st.threshold, st.recent, st.tripped_at, st.tripped_by, st.reason,
         st.rearmed_at, st.rearmed_by),
    )  # fmt: skip


def _event(conn: Any, event: str, data: dict[str, Any]) -> None:
    from psycopg.types.json import Jsonb

    conn.execute("INSERT INTO fila_breaker_events (event, data) VALUES (%s, %s)", (event, Jsonb(data)))


def count(conn: Any, rec: Record, *, runner: str, threshold: int | None, at: datetime) -> BreakerState:
    """Count the outcome `rec` that `conn`'s transaction writes at `at` (the database's clock)
    by the file queue's rules (queue/breaker.py's `step`): `threshold` is the task's policy's, else
    the default. Returns the state as this transaction leaves it."""
    limit = threshold if threshold is not None else DEFAULT_THRESHOLD
    if verdict(rec) != "failure":
        # What counts nothing, and a success with nothing to reset (most outcomes), take no lock:
        # publishes do not queue behind each other.
        seen = read_on(conn)
        if not step(seen, rec, threshold=limit, by=runner, at=iso(at)).changed:
            return seen
    done = step(_locked(conn), rec, threshold=limit, by=runner, at=iso(at))
    if done.changed:
        _save(conn, done.state)
    if done.tripped:
        _event(conn, "tripped", {"runner": runner, **trip_data(done.state)})
    return done.state


def read_on(conn: Any) -> BreakerState:
    """The breaker as `conn` sees it (no lock)."""
    return _state(conn.execute(f"SELECT {COLUMNS} FROM fila_breaker").fetchone())


class PgBreaker(Database):
    """A queue database's breaker, read and rearmed (PgQueue is one, for its runners)."""

    def breaker(self) -> BreakerState:
        """The breaker's state now."""
        return self._tx(lambda conn, _again: read_on(conn))

    def breaker_events(self) -> list[dict[str, Any]]:
        """Its trips and rearms, oldest first."""
        rows = self._tx(
            lambda conn, _again: conn.execute(
                "SELECT at, event, data::text FROM fila_breaker_events ORDER BY seq"
            ).fetchall()
        )
        return [event_line(_iso(at), ev, text) for at, ev, text in rows]  # read as untrusted

    def rearm(self, *, by: str, reason: str | None = None) -> BreakerState:
        """A person's decision to let runners claim again: the count reset, recorded with who and
        when (an event, whether or not it was open)."""

        def run(conn: Any, _again: bool) -> BreakerState:
            was = _locked(conn)
            at = iso(conn.execute("SELECT now()").fetchone()[0])
            st = BreakerState(rearmed_at=at, rearmed_by=by, threshold=was.threshold)
            _save(conn, st)
            _event(conn, "rearmed", {"by": by, "reason": reason, "was_open": was.open,
                                     "consecutive": was.consecutive, "tasks": was.recent})  # fmt: skip
            return read_on(conn)

        return self._tx(run)
