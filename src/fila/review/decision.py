"""A person's decision on a task (docs/architecture.md, "The cycle", step 7): who, when, why; recorded once.

The status change goes through `queue.set_status` with `expect=` (the transition table forbids
applied -> rejected, rejected -> applied and applying twice); `lock` additionally serialises
whole decisions on one host, so two people applying at once cannot both write the project.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import unicodedata
from collections.abc import Iterator
from typing import Any, Protocol

from ..core.errors import InvalidInput, InvalidTransition
from ..core.fsutil import file_lock
from ..core.layout import Root
from ..core.models import Decision, Record, Status, now_iso
from ..provenance.sources import FileSource, Source
from ..queue import store as queue

DECIDABLE = {"apply": {Status.needs_review},
             "reject": {Status.needs_review, Status.needs_human, Status.failed}}  # fmt: skip


def decider(by: str | None) -> str:
    """`--by`, else $FILA_USER, else the login name."""
    name = by or os.environ.get("FILA_USER") or _login()
    name = name.strip()
    if not name or len(name) > 200 or any(unicodedata.category(c) == "Cc" for c in name):
        raise InvalidInput(
            f"invalid name for the decision: {name!r}",
            hint="pass --by NAME (at most 200 characters, no control characters)",
        )
    return name


def _login() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # a container's uid without a passwd entry
        return f"uid{os.getuid()}"


def check_reason(reason: str | None) -> str | None:
    if reason is not None and len(reason) > 4000:
        raise InvalidInput("the reason is longer than 4000 characters", hint="shorten --reason")
    if reason is None or not reason.strip():
        return None
    return reason.strip()


@contextlib.contextmanager
def lock(root: Root, task_id: str) -> Iterator[None]:
    """Held for a whole decision (check, write the project, record)."""
    meta = root.meta(task_id)
    meta.mkdir(parents=True, exist_ok=True)
    with file_lock(meta / "decide.lock"):
        yield


def check_undecided(rec: Record, action: str) -> None:
    """Refuse a decision the task's status does not allow, saying what was decided before."""
    if rec.status in DECIDABLE[action]:
        return
    d = rec.decision
    if d is not None and d.action in ("applied", "rejected", "superseded"):
        msg = (
            f"task {rec.id} was already {d.action} by {d.by} at {d.at}"
            + (f" ({d.reason})" if d.reason else "")
            + f"; it cannot be {_past(action)} now"
        )
        hint = "a decision is final; submit a new task to try again"
    else:
        msg = (
            f"task {rec.id} is {rec.status}; only a task in "
            + " or ".join(sorted(DECIDABLE[action]))
            + f" can be {_past(action)}"
        )
        hint = "`fila show ID` shows its state; `fila run --once` processes queued tasks"
    raise InvalidTransition(msg, task_id=rec.id, hint=hint)


def _past(action: str) -> str:
    return {"apply": "applied", "reject": "rejected"}[action]


def record(root: Root, task_id: str, action: str, *, by: str, reason: str | None,
           expect: set[Status]) -> Record:  # fmt: skip
    """Write the decision with the status change, once (set_status checks the transition)."""
    to = Status.applied if action == "apply" else Status.rejected
    decision = Decision(action=to.value, by=by, at=now_iso(), reason=reason)
    return queue.set_status(
        root,
        task_id,
        to,
        expect=expect,
        event=to.value,
        decision=decision,
        log={"decision": decision.model_dump(mode="json")},
    )


class Book(Protocol):
    """Where a task's record and its decision live, for `apply` (review/apply.py): the file queue
    under the root (FILE), or a PostgreSQL queue (review/remote.py), which records a decision once
    for every host that reaches it."""

    def get(self, root: Root, task_id: str) -> Record: ...

    def log(self, root: Root, task_id: str, event: str, **data: Any) -> None: ...

    def decide(self, root: Root, task_id: str, action: str, *, by: str, reason: str | None,
               expect: set[Status]) -> Record: ...  # fmt: skip

    def source(self, root: Root) -> Source: ...


class FileBook:
    """The file queue under the root: its records, its event logs, `record` for the decision."""

    def get(self, root: Root, task_id: str) -> Record:
        return queue.get_record(root, task_id)

    def log(self, root: Root, task_id: str, event: str, **data: Any) -> None:
        queue.log_event(root, task_id, event, **data)

    def decide(self, root: Root, task_id: str, action: str, *, by: str, reason: str | None,
               expect: set[Status]) -> Record:  # fmt: skip
        return record(root, task_id, action, by=by, reason=reason, expect=expect)

    def source(self, root: Root) -> Source:
        """Where the task's statements and the trusted keys are (docs/provenance.md)."""
        return FileSource(root)


FILE = FileBook()


def reject(root: Root, task_id: str, *, by: str | None = None, reason: str | None = None) -> Record:
    """Reject a task that is ready for review, failed or needs a person. Writes nothing in the
    project; the job directory stays until `fila gc`."""
    from . import attested, landing

    who, why = decider(by), check_reason(reason)
    queue.get_record(root.require(), task_id)  # NotFound before any lock file is made
    with lock(root, task_id):
        rec = queue.get_record(root, task_id)
        check_undecided(rec, "reject")
        landing.forget_untouched_interrupted(root, task_id)
        rec = record(root, task_id, "reject", by=who, reason=why, expect=DECIDABLE["reject"])
    attested.sign_decision(root, FileSource(root), rec)
    return rec
