"""What a runner of the PostgreSQL queue writes into the database at a claim's end (run/remote.py,
docs/scale-out.md): the outcome of the run path with the blobs a reviewer needs, in one publish
that a stale token cannot make; a hand back when the run path handed the task back before its
container started; a refusal when the task's targets did not arrive intact."""

from __future__ import annotations

import re
from collections.abc import Callable

from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Record, Status
from ..queue.pg.blobs import Blob
from ..queue.pg.records import RESULT_FIELDS, on_db_clock
from ..queue.pg.store import INPUTS, OUTCOMES, Lease, PgQueue
from ..queue.retry import INFRA


def refuse(q: PgQueue, lease: Lease, backend: str, msg: str) -> Record | None:
    """A task this runner refuses before any container (its targets do not arrive intact)."""
    error = ErrorInfo(kind=ErrorKind.invalid, message=msg)
    return q.publish(lease.task_id, lease.token, Status.failed, {"error": error, "backend": backend})


def publish(
    q: PgQueue, lease: Lease, jr: Root, manifest: bytes, rec: Record, progress: Callable[[str], None]
) -> Record | None:
    """The local record `rec` of job root `jr` published under the lease's token (None: the
    lease was lost first, nothing written), or handed back when the run path left it queued."""
    tid = lease.task_id
    if rec.status == Status.queued:  # handed back before its container started
        counted = rec.error is not None and rec.error.kind == ErrorKind.infra
        q.hand_back(tid, lease.token, rec.error, counted=counted,
                    backoff_s=INFRA.backoff(1) if counted else 0.0)  # fmt: skip
        return None
    if rec.status not in OUTCOMES:
        raise AssertionError(f"task {tid}: the run path ended {rec.status}")
    rec = no_local_paths(rec, jr, tid)
    blobs = [Blob.of(INPUTS, manifest)]
    fields = {k: getattr(rec, k) for k in RESULT_FIELDS if getattr(rec, k, None) is not None}
    for name, rel, key in (
        ("DIFF.patch", rec.patch_path, "patch_path"),
        ("log", rec.log_path, "log_path"),
    ):
        path = jr.path / rel if rel else None
        if path is not None and path.is_file():
            blobs.append(Blob.of(name, path.read_bytes()))
            fields[key] = name
        else:
            fields.pop(key, None)
    if jr.events_path(tid).is_file():
        blobs.append(Blob.of("events.jsonl", jr.events_path(tid).read_bytes()))
    ran = [
        a.model_copy(
            update={"log_path": "log" if i == len(rec.attempts) - 1 and "log_path" in fields else None}
        )
        for i, a in enumerate(rec.attempts)
    ]
    # This host's clock may be off (the lease never depends on it); the record's times are
    # the database's, so the attempts' are moved onto its clock as measured at the claim.
    ran = on_db_clock(ran, lease.clock_offset_s)
    out = q.publish(tid, lease.token, rec.status, fields, blobs, ran=ran, threshold=threshold(jr, lease))
    if out is None:
        progress(f"{tid}: the lease was lost before the publish; the result is discarded")
    return out


def threshold(jr: Root, lease: Lease) -> int | None:
    """The task's policy's max_consecutive_failures as this host has it (the breaker's threshold
    when this outcome is a failure); None (the default) when the policy does not load."""
    from ..core.errors import FilaError
    from ..queue.policy import load_policy

    try:
        return load_policy(jr, lease.task.policy)[0].max_consecutive_failures
    except FilaError:
        return None


def no_local_paths(rec: Record, jr: Root, tid: str) -> Record:
    """The record with every path into the job root (`see .../remote/<id>.<token>/fila/logs/...`
    in an error) replaced by the command that shows the published log: the job root is gone
    after the publish, and it is on the runner's host, not the reader's. The queue's URL is not
    written in (it may carry credentials, and a reviewer has their own)."""
    where = re.compile(re.escape(str(jr.path)) + r"/[^\s;,)'\"]*")
    say = f"`fila logs {tid} --queue URL`"

    def fixed(err: ErrorInfo | None) -> ErrorInfo | None:
        if err is None or not where.search(err.message):
            return err
        return err.model_copy(update={"message": where.sub(say, err.message)})

    attempts = [a.model_copy(update={"error": fixed(a.error)}) for a in rec.attempts]
    return rec.model_copy(update={"error": fixed(rec.error), "attempts": attempts})
