"""The review gate over either queue kind: one function per question and per decision, which the
command line (cli/review.py, cli/upkeep.py) and the browser (web/) both call, so a decision taken
in a page goes through exactly the code a decision taken in a terminal does (docs/review-web.md).

`db` is a PostgreSQL queue (queue/pg/store.PgQueue) or None for the file queue under `root`.
With a queue, `root` is the reviewer's own queue root: where `apply` lands the patch and whose
policies judge it (review/remote.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.layout import Root
from ..core.models import Record, Status
from ..queue import store
from . import attested, decision, groups, report
from .apply import Applied, apply

if TYPE_CHECKING:
    from ..queue.pg.db import Database
    from ..queue.pg.store import PgQueue


def listing(
    root: Root, db: Database | None, status: Status | None = None, *, cache: dict[str, Any] | None = None
) -> tuple[list[Record], list[str], list[tuple[str, str]]]:
    """`fila ls`: the records (oldest submitted first), the ids of task files dropped in fila/in
    with no record yet (the file queue's), and (id, why) of each row that does not read (a
    PostgreSQL queue's). `cache`: the file queue's records kept between calls (queue/records.
    all_records)."""
    if db is not None:
        recs, unreadable = db.listing(status)
        return recs, [], unreadable
    recs, dropped = store.listing(root.require(), status, cache=cache)
    return recs, dropped, []


def record(root: Root, db: PgQueue | None, task_id: str) -> Record:
    """The task's record; NotFound for an unknown id, InvalidId for a name that is no id."""
    return db.get(task_id) if db is not None else store.get_record(root.require(), task_id)


def review(root: Root, db: PgQueue | None, task_id: str) -> report.Review:
    """`fila review`: the record, its DIFF.patch checked against the sha256 the record names (refused
    when it changed), and the warnings."""
    if db is not None:
        from .remote import review_queued

        return review_queued(root, db, task_id)
    return report.load(root, task_id)


def compare(root: Root, db: PgQueue | None, group: str) -> groups.Comparison:
    """`fila compare`: a compare group's members side by side."""
    if db is not None:
        from .remote import compare_queued

        return compare_queued(db, group)
    return groups.compare(root, group)


def log_since(root: Root, db: PgQueue | None, task_id: str, offset: int, limit: int) -> tuple[bytes, int]:
    """The engine's log from byte `offset` (at most `limit` bytes; a negative offset: its last
    `-offset` bytes) and the offset after what was read. A log shorter than `offset` was rewritten
    by a new attempt: read from its start. A PostgreSQL queue's log is the blob its runner
    published when the task ended (review/remote.queued_log)."""
    if db is not None:
        from .remote import queued_log

        data = queued_log(db, task_id)
        start = _start(len(data), offset)
        chunk = data[start : start + limit]
        return chunk, start + len(chunk)
    store.get_record(root.require(), task_id)  # NotFound for an unknown id
    try:
        fd = os.open(root.log_path(task_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # no log yet (queued), or not a regular file fila wrote
        return b"", 0
    try:
        start = _start(os.fstat(fd).st_size, offset)
        os.lseek(fd, start, os.SEEK_SET)
        chunk = os.read(fd, limit)
        return chunk, start + len(chunk)
    finally:
        os.close(fd)


def _start(size: int, offset: int) -> int:
    if offset < 0:
        return max(0, size + offset)
    return offset if offset <= size else 0


def apply_task(
    root: Root, db: PgQueue | None, task_id: str, *, attestations: Path | None = None, **options: Any
) -> Applied:
    """`fila apply`: the reviewed patch into the project, or nothing (review/apply.py; with a
    queue, review/remote.apply_queued lands it in `root`). `options` are apply's (by, reason,
    three_way, allow_git_metadata, allow_credential). `attestations`: a directory the task's
    statements are written to once it is applied, beside the landing (docs/provenance.md, "Into
    the project's history"); checked before anything lands."""
    if db is not None:
        from .remote import QueueBook, apply_queued

        source = QueueBook(db).source(root)
        land: Callable[..., Applied] = functools.partial(apply_queued, root, db)
    else:
        source = decision.FILE.source(root)
        land = functools.partial(apply, root)
    if attestations is not None:
        attested.check_beside(source, task_id, attestations)
    res = land(task_id, **options)
    if attestations is not None:
        res.attestations = [str(p) for p in attested.write_beside(source, task_id, attestations)]
    return res


def reject_task(
    root: Root, db: PgQueue | None, task_id: str, *, by: str | None, reason: str | None
) -> Record:
    """`fila reject`: the refusal recorded once; the project is not touched."""
    if db is not None:
        from .remote import reject_queued

        return reject_queued(db, task_id, by=by, reason=reason, root=root)
    return decision.reject(root, task_id, by=by, reason=reason)


def retry_task(root: Root, db: PgQueue | None, task_id: str, *, by: str | None, reason: str | None) -> Record:
    """`fila retry`: a failed or needs_human task queued again, the person's decision recorded."""
    who, why = decision.decider(by), decision.check_reason(reason)
    if db is not None:
        return db.retry(task_id, by=who, reason=why)
    return store.retry(root.require(), task_id, by=who, reason=why)
