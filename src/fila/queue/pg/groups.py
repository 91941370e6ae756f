"""Compare groups in the PostgreSQL queue (docs/scale-out.md; the file queue's are
review/groups.py): a submit that joins a group whose member was applied is refused
(`check_joinable`), and the apply of one member and the supersedes of the others are one
transaction (`PgGroups.decide_group`), so that one member of a group lands, whatever the hosts
of its reviewers. The rules (check_group, the supersede's reason) are queue/records.py's, both
queues'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.errors import InvalidTransition, NotFound
from ...core.models import Decision, Record, Status
from ..records import check_group, superseded_by, superseded_reason
from . import records
from .db import Database

S = Status


@dataclass
class GroupDecision:
    """What `decide_group` wrote: the applied record, the members it superseded, and those it
    left because they were still queued or running."""

    record: Record
    superseded: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)


def _same(a: Decision | None, b: Decision) -> bool:
    """The same person's same decision, whatever its time (a retry's clock is later)."""
    return a is not None and (a.action, a.by, a.reason) == (b.action, b.by, b.reason)


def check_joinable(conn: Any, task_id: str, group: str) -> None:
    """Refuse (InvalidTransition, in the submit's transaction `conn`: nothing written) task
    `task_id` joining compare group `group` one of whose members was applied already: it would
    run and could never be applied (queue/records.check_group). A decide_group committing at the
    same moment can still be missed; that member is then refused when applied (check_group)."""
    row = conn.execute(
        "SELECT t.id, r.record->'decision'->>'by', r.record->'decision'->>'at' FROM fila_tasks t "
        "JOIN fila_records r USING (id) WHERE t.task->>'group' = %s AND t.state = 'applied' "
        "ORDER BY t.id LIMIT 1",
        (group,),
    ).fetchone()
    if row is not None:
        raise InvalidTransition(
            f"task {task_id} joins group {group!r}, whose member {row[0]} was applied"
            + (f" by {row[1]} at {row[2]}" if row[1] else ""),
            task_id=task_id,
            hint="one member of a group lands; submit it in a new group (or none); nothing "
            "of this submit was queued",
        )


class PgGroups(Database):
    """A queue database's compare groups, read and decided (PgQueue is one)."""

    def group_records(self, group: str) -> list[Record]:
        """The records of a compare group's members (tasks whose `group` is `group`), by id;
        an empty list when no task has that group. Each record's id must be its row's (Refused,
        as db.py's _record: a record's id names paths and blobs)."""
        sql = (
            "SELECT t.id FROM fila_tasks t JOIN fila_records r USING (id) "
            "WHERE t.task->>'group' = %s ORDER BY t.id"
        )
        return self._tx(
            lambda conn, _again: [self._record(conn, r[0]) for r in conn.execute(sql, (group,)).fetchall()]
        )

    def decide_group(
        self, task_id: str, decision: Decision, *, expect: set[Status], supersede: set[Status]
    ) -> GroupDecision:
        """A person's `applied` of a task, and of the other members of its compare group: the
        decision and every supersede in ONE transaction (a task in no group: as `decide`).

        The transaction locks every member's row (`FOR UPDATE`, in id order, so two deciders of
        one group queue behind each other and never deadlock) before it reads a record. Then:
        a member other than this one already `applied` refuses the decision (InvalidTransition
        naming that member, who and when: nothing written); this task must be in `expect`
        (InvalidTransition otherwise); every other member in `supersede` becomes `rejected` with
        a decision `superseded` (who, when, "group G: ID was applied"), and members still queued
        or running are left as they are and named in `undecided` (a person rejects them when they
        end; the member applied first wins: queue/records.check_group refuses theirs). Two reviewers who
        apply two members at once: the second transaction waits for the first's locks, then finds
        the first's member applied and changes nothing. Sent again after a lost reply, it
        returns what the first one wrote (recognised by action, who and reason: the `at` of the
        decision, like the supersedes', is the database's clock at the commit, not the caller's)."""
        if decision.action != S.applied.value:
            raise InvalidTransition(
                f"only an applied decision supersedes, not {decision.action}", task_id=task_id
            )

        def run(conn: Any, _again: bool) -> GroupDecision:
            row = conn.execute("SELECT task->>'group', now() FROM fila_tasks WHERE id = %s",
                               (task_id,)).fetchone()  # fmt: skip
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            group, at = row
            ids = [task_id]
            if group is not None:
                ids = [r[0] for r in conn.execute(
                    "SELECT id FROM fila_tasks WHERE task->>'group' = %s ORDER BY id FOR UPDATE", (group,)
                ).fetchall()]  # fmt: skip
            else:
                conn.execute("SELECT 1 FROM fila_tasks WHERE id = %s FOR UPDATE", (task_id,))
            recs = {i: self._record(conn, i) for i in ids}
            cur = recs[task_id]
            made = decision.model_copy(update={"at": records.iso(at)})
            if cur.status == S.applied and _same(cur.decision, made):  # ours, its reply lost
                done = superseded_by(list(recs.values()), group, task_id)
                left = [i for i, r in recs.items() if r.status in (S.queued, S.running)]
                return GroupDecision(cur, done, left)
            check_group(cur, [r for i, r in recs.items() if i != task_id])
            rec = records.transition(task_id, cur, S.applied, at, expect=expect, changes={"decision": made})
            self._decided(conn, task_id, cur, rec, "decided", made)
            out = GroupDecision(rec)
            for i, other in recs.items():
                if i == task_id:
                    continue
                if other.status in (S.queued, S.running):
                    out.undecided.append(i)
                    continue
                if other.status not in supersede:
                    continue  # decided before: its history stays
                d = Decision(action="superseded", by=decision.by, at=records.iso(at),
                             reason=superseded_reason(group, task_id))  # fmt: skip
                new = records.transition(i, other, S.rejected, at, expect=supersede, changes={"decision": d})
                self._decided(conn, i, other, new, "superseded", d)
                out.superseded.append(i)
            return out

        return self._tx(run)

    def _decided(self, conn: Any, task_id: str, cur: Record, rec: Record, event: str, d: Decision) -> None:
        """A person's decision written: the row's state, the record, the event (in `conn`'s
        transaction)."""
        conn.execute("UPDATE fila_tasks SET state = %s, updated_at = now() WHERE id = %s",
                     (str(rec.status), task_id))  # fmt: skip
        data = {"from": str(cur.status), "to": str(rec.status), "by": d.by, "reason": d.reason}
        self._write(conn, task_id, rec, event, data)
