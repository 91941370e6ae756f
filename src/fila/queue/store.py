"""The claims of the file queue (docs/architecture.md, "The queue's contract"): submit, claim,
heartbeat, fencing, publish and hand back. The records and their one state machine are
queue/records.py; its public names are re-exported here, so `store` stays the file queue's one
entry point.

Where a task is:
    fila/in/<id>.json                       queued (a person or CI may drop one here)
    fila/run/<id>~<worker>~<token>.json     claimed by <worker>; its mtime is the heartbeat (lease)
    fila/run/<id>~<worker>~<token>.done     the worker won the completion race and is publishing
    fila/run/<id>~<worker>~<token>.reaped   recovery won the race against a stale claim
    fila/out/<id>.json                      the record, written only under the record lock
    fila/logs/<id>.events.jsonl             every event, appended

Every ownership change is one rename of the one claim file: a worker completing and a reaper
expiring its lease race on that rename, exactly one wins, and the loser never publishes. The
token makes each claim's name unique, so a stale thread can never mistake a later claim of the
same task (even by its own worker) for its own.

Fencing: every write a worker makes to a record (begin, checkpoint, hand back, publish) happens
under the record lock after checking that its claim file (or its .done tombstone) still exists.
The reaper renames first and decides under the same lock afterwards, so it always sees the
worker's last write, and the worker never writes after the reaper decided.

Order of the two writes that move a task, so that a crash between them leaves a state recovery
recognises: submit and retry write the record (queued) first, then the file; a hand back moves
the file first, then writes the record. Both happen under the record lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import fsutil, untrusted
from ..core.errors import DuplicateId, InvalidTransition, Refused
from ..core.faults import crash_point
from ..core.layout import Root, check_id
from ..core.models import Decision, ErrorInfo, Record, Status, Task, now_iso, valid_id
from .lease import this_host
from .records import ALLOWED as ALLOWED
from .records import FIXED_FIELDS as FIXED_FIELDS
from .records import OUTCOME_OF as OUTCOME_OF
from .records import RUN_FIELDS as RUN_FIELDS
from .records import all_records as all_records
from .records import claim_changes as claim_changes
from .records import close_attempt as close_attempt
from .records import field_problem as field_problem
from .records import get_record as get_record
from .records import locked as locked
from .records import log_chunks as log_chunks
from .records import log_event as log_event
from .records import next_record as next_record
from .records import read_events as read_events
from .records import read_record as read_record
from .records import set_status as set_status
from .records import task_json as task_json
from .records import transition_locked as transition_locked

S = Status
CLAIM_SEP = "~"


class LeaseLost(Exception):
    """The claim is no longer this worker's (reaped or handed back): it must not publish."""


def new_worker_id() -> str:
    return f"{this_host()}-{os.getpid()}-{secrets.token_hex(2)}"


def new_task_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


# -- listing --------------------------------------------------------------------------------


def listing(
    root: Root, status: Status | None = None, *, cache: dict[str, Any] | None = None
) -> tuple[list[Record], list[str]]:
    """`fila ls`: the records (of one status, or all), oldest submitted first, and the ids of
    task files dropped in fila/in that have no record yet (they count as queued). `cache`: see
    records.all_records."""
    recs = all_records(root, cache)
    known = {rec.id for rec in recs}
    dropped = [p.stem for p in queued_files(root) if p.stem not in known]
    if status is not None:
        recs = [x for x in recs if x.status == status]
    recs.sort(key=lambda x: x.submitted_at)
    return recs, dropped if status in (None, S.queued) else []


# -- submit and claim ------------------------------------------------------------------------


def claim_files(root: Root, task_id: str) -> list[Path]:
    """Every claim and tombstone of one task in run/ (ids hold no glob characters)."""
    return sorted(root.run_dir.glob(f"{check_id(task_id)}{CLAIM_SEP}*"))


def id_in_use(root: Root, task_id: str) -> str | None:
    """Where the id exists already, or None. Idempotency: such an id is refused at submit."""
    places = [
        root.queued_path(task_id),
        root.record_path(task_id),
        root.job_dir(task_id),
        root.rejected_dir / f"{task_id}.json",
    ]
    for p in places:
        if p.exists() or p.is_symlink():
            return str(p)
    if claim_files(root, task_id):
        return str(root.run_dir)
    return None


def enqueue(root: Root, task_id: str, task: Task) -> Record:
    """Queue a validated task: the record first (it reserves the id), then `in/<id>.json`, both
    under the record lock. A crash between the two leaves a queued record without its file;
    recovery writes the file again from the record, which holds the whole task."""
    where = id_in_use(root, task_id)
    if where:
        raise DuplicateId(
            f"task id {task_id!r} exists already ({where})",
            task_id=task_id,
            hint="choose another id, or omit it to get a new one",
        )
    task = task.model_copy(update={"id": task_id})
    with locked(root, task_id):
        rec = transition_locked(
            root,
            task_id,
            None,
            S.queued,
            expect=None,
            task=task,
            event="submitted",
            log=None,
            outcome=None,
            changes={},
        )
        if not fsutil.create_exclusive(root.queued_path(task_id), task_json(task)):
            raise DuplicateId(f"task file {root.queued_path(task_id)} appeared meanwhile")
    return rec


def _is_task_name(name: str) -> bool:
    return name.endswith(".json") and valid_id(name[: -len(".json")])


def queued_files(root: Root) -> list[Path]:
    """Task files waiting in in/ (`<id>.json`, whatever kind of entry), oldest first. Hidden
    and temporary files are not tasks; other names are `stray_entries`."""
    out = []
    with os.scandir(root.in_dir) as it:
        for e in it:
            if e.name.startswith(".") or not _is_task_name(e.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                out.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name, Path(e.path)))
    return [p for _, _, p in sorted(out)]


def stray_entries(root: Root) -> list[Path]:
    """Entries of in/ that can never be a task: not hidden, and not named `<id>.json` (a name
    with a space, a control character or a trailing newline, another suffix)."""
    with os.scandir(root.in_dir) as it:
        return sorted(Path(e.path) for e in it if not e.name.startswith(".") and not _is_task_name(e.name))


def reject_stray(root: Root, src: Path) -> Path | None:
    """Move a stray entry to fila/rejected/ under a safe name, with a `.reason` that names it.
    Its name is never used as an id or as a file name. None when another worker moved it."""
    try:
        mode = os.lstat(src).st_mode
    except FileNotFoundError:
        return None
    what = "a file" if stat.S_ISREG(mode) else untrusted.entry_kind(mode)
    reason = (
        f"{src.name!r} ({what}) in {root.in_dir} is not a task file: a task file is named <id>.json "
        f"with the id made of 1-128 of [A-Za-z0-9._-]; rename it and drop it again"
    )
    try:
        safe = f"stray.{untrusted.safe_name(src.name)}.{secrets.token_hex(3)}"
        return reject_file(root, src, reason, name=safe)
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Claim:
    task_id: str
    worker: str
    token: str
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.task_id}{CLAIM_SEP}{self.worker}{CLAIM_SEP}{self.token}"

    @property
    def path(self) -> Path:
        return self.run_dir / f"{self.name}.json"

    def tombstone(self, suffix: str) -> Path:
        return self.run_dir / f"{self.name}.{suffix.lstrip('.')}"


def parse_claim(path: Path) -> tuple[Claim, str] | None:
    """`<id>~<worker>~<token>.<json|done|reaped>` -> (claim, suffix)."""
    stem, dot, suffix = path.name.rpartition(".")
    parts = stem.split(CLAIM_SEP)
    if not dot or len(parts) != 3 or not valid_id(parts[0]) or not all(parts):
        return None
    return Claim(parts[0], parts[1], parts[2], path.parent), suffix


def claims(root: Root) -> list[tuple[Claim, str]]:
    out = []
    for p in sorted(root.run_dir.iterdir()):
        parsed = parse_claim(p)
        if parsed:
            out.append(parsed)
    return out


def try_claim(root: Root, src: Path, worker: str) -> Claim | None:
    """Claim one queued file by renaming it into run/: exactly one worker's rename succeeds."""
    task_id = src.stem
    if not valid_id(task_id) or CLAIM_SEP in worker:
        return None
    claim = Claim(task_id, worker, secrets.token_hex(4), root.run_dir)
    try:
        # rename keeps the mtime, and the claim's mtime is its heartbeat: a task that waited
        # longer than the lease TTL would look stale the moment it is claimed.
        os.utime(src, follow_symlinks=False)  # a symlink's target is never touched
        fsutil.durable_rename(src, claim.path)
    except FileNotFoundError:
        return None  # another worker won
    log_event(root, task_id, "claimed", worker=worker, claim=claim.name)
    return claim


def heartbeat(claim: Claim) -> bool:
    """Refresh the lease; False when it is gone (reaped), so the worker must not publish."""
    try:
        os.utime(claim.path, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def holds(claim: Claim) -> bool:
    # lexists: a claimed entry may be a dangling symlink (a hostile drop) and is still held.
    return os.path.lexists(claim.path)


def _fence(claim: Claim, *, suffix: str = "json") -> Callable[[Record | None], None]:
    """A guard: the claim (or its tombstone) still exists and the record is this worker's."""

    def guard(cur: Record | None) -> None:
        if not os.path.lexists(claim.tombstone(suffix)):
            raise LeaseLost(f"{claim.name}: the claim is gone")
        if cur is None or cur.status != S.running or cur.worker != claim.worker:
            raise LeaseLost(
                f"{claim.name}: the record is no longer this claim's ({cur.status if cur else 'no record'})"
            )

    return guard


def begin(root: Root, claim: Claim, task: Task) -> Record:
    """queued -> running for a claimed task: attempt + 1, a new open attempt. A file dropped
    straight into fila/in/ gets its record here. Raises LeaseLost when the claim was reaped and
    InvalidTransition when the record is not queued (the file is a duplicate, or a hand back was
    interrupted: recovery tells them apart)."""
    tid = claim.task_id
    with locked(root, tid):
        if not claim.path.exists():
            raise LeaseLost(f"{claim.name}: the claim is gone")
        cur = read_record(root, tid)
        if cur is None:
            cur = transition_locked(
                root,
                tid,
                None,
                S.queued,
                expect=None,
                task=task,
                event="submitted",
                log={"via": "file dropped in fila/in"},
                outcome=None,
                changes={},
            )
        attempt = cur.attempt + 1
        return transition_locked(
            root,
            tid,
            cur,
            S.running,
            expect={S.queued},
            task=task,
            event="started",
            log={"claim": claim.name},
            outcome=None,
            changes=claim_changes(cur, attempt, task.engine, claim.worker, now_iso()),
        )


def checkpoint(root: Root, claim: Claim, *, event: str = "checkpoint", **fields: Any) -> Record:
    """running -> running with new fields, only while the claim is this worker's."""
    return set_status(
        root, claim.task_id, S.running, expect={S.running}, guard=_fence(claim), event=event, **fields
    )


def win(claim: Claim, suffix: str) -> bool:
    """Take final ownership of a claim (worker: 'done'; reaper: 'reaped'). One rename, one winner."""
    try:
        fsutil.durable_rename(claim.path, claim.tombstone(suffix))
        return True
    except FileNotFoundError:
        return False


def release(root: Root, claim: Claim, suffix: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(claim.tombstone(suffix))
    if suffix == "done":  # its pending result is published: it must never be published again
        with contextlib.suppress(FileNotFoundError):
            result_path(root, claim).unlink()
    with contextlib.suppress(FileNotFoundError):
        fsutil.fsync_dir(claim.run_dir)


def result_path(root: Root, claim: Claim) -> Path:
    """The pending result of one claim: per claim, so a late worker cannot overwrite another's."""
    return root.meta(claim.task_id) / f"result.{claim.token}.json"


def publish(
    root: Root, claim: Claim, status: Status, fields: dict[str, Any], *, attempt: int
) -> Record | None:
    """Publish a worker's outcome exactly once, or not at all when its lease is lost.

    The pending result goes to sandbox/meta/<id>/result.<token>.json first, so that a worker
    killed after winning the race can be finished by recovery from it; then the race (rename to
    .done); then the record; then the tombstone and the pending result go.
    """
    from pydantic_core import to_jsonable_python

    meta = root.meta(claim.task_id)
    meta.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(
        result_path(root, claim),
        json.dumps(
            {"claim": claim.name, "attempt": attempt, "status": status, "fields": to_jsonable_python(fields)},
            indent=1,
        ),
    )
    crash_point("after_result")
    if not win(claim, "done"):
        log_event(root, claim.task_id, "result discarded", reason="lease lost", claim=claim.name)
        with contextlib.suppress(FileNotFoundError):
            result_path(root, claim).unlink()
        return None
    crash_point("after_win")
    rec = finish_done(root, claim, status, fields, attempt=attempt)
    crash_point("after_record")
    release(root, claim, "done")
    return rec


def finish_done(
    root: Root,
    claim: Claim,
    status: Status,
    fields: dict[str, Any],
    *,
    attempt: int,
    log: dict[str, Any] | None = None,
) -> Record | None:
    """Write the outcome of a claim that won the race (.done exists) for its attempt.
    Idempotent: when the record was finished already (by recovery, or by the worker), or has
    moved on to a later attempt, it is returned unchanged."""
    tid = claim.task_id
    with locked(root, tid):
        cur = read_record(root, tid)
        if (
            not claim.tombstone("done").exists()
            or cur is None
            or cur.status != S.running
            or cur.worker != claim.worker
            or cur.attempt != attempt
        ):
            return cur
        return transition_locked(
            root,
            tid,
            cur,
            status,
            expect={S.running},
            task=None,
            event=None,
            log=log,
            outcome=None,
            changes=dict(fields),
        )


def hand_back(
    root: Root,
    claim: Claim,
    *,
    suffix: str = "json",
    error: ErrorInfo | None = None,
    outcome: str = "handed back",
    not_before: float | None = None,
    event: str = "requeued",
    log: dict[str, Any] | None = None,
) -> bool:
    """Give a claimed task back to in/ (its container never started), then mark the record
    queued. False when the claim is gone or the record is not this claim's."""
    tid = claim.task_id
    with locked(root, tid):
        cur = read_record(root, tid)
        mine = cur is not None and cur.status == S.running and cur.worker == claim.worker
        if cur is not None and cur.status not in (S.queued,) and not mine:
            return False
        if mine and cur is not None and cur.container_started:
            raise Refused(f"task {tid}: its container started; it cannot be requeued silently")
        dst = root.queued_path(tid)
        while True:
            try:
                fsutil.rename_noreplace(claim.tombstone(suffix), dst)
                break
            except FileNotFoundError:
                return False
            except FileExistsError:
                # Someone dropped a new file with this id while it was claimed: a duplicate id,
                # kept aside with the reason (never silently replaced, never deleted).
                with contextlib.suppress(FileNotFoundError):
                    reject_file(
                        root,
                        dst,
                        f"task id {tid} was claimed when this file appeared; duplicate ids are refused",
                        name=f"{tid}.json",
                    )
        crash_point("during_hand_back")
        if mine:
            transition_locked(
                root,
                tid,
                cur,
                S.queued,
                expect={S.running},
                task=None,
                event=event,
                log=log,
                outcome=outcome,
                changes=dict(not_before=not_before, error=error),
            )
        else:
            log_event(root, tid, "handed back", claim=claim.name, **(log or {}))
    return True


def unclaim(root: Root, claim: Claim) -> None:
    """Put a claimed file back into in/ untouched, without changing the record: the worker could
    not begin it (its record is not queued) and recovery decides what it is."""
    with locked(root, claim.task_id):
        dst = root.queued_path(claim.task_id)
        with contextlib.suppress(FileNotFoundError):
            if dst.exists():
                reject_file(
                    root, claim.path, f"a second file for task {claim.task_id}", name=f"{claim.task_id}.json"
                )
            else:
                fsutil.durable_rename(claim.path, dst)


def retry(root: Root, task_id: str, *, by: str, reason: str | None = None) -> Record:
    """A person's explicit requeue of a task that failed or needs a human: the record says
    queued (with the decision) first, then the task file is written again from the record."""
    with locked(root, task_id):
        cur = get_record(root, task_id)
        left = claim_files(root, task_id)
        if left:
            raise InvalidTransition(
                f"task {task_id} still has {left[0].name} in fila/run/",
                task_id=task_id,
                hint="run `fila recover` first",
            )
        if cur.task is None:
            raise InvalidTransition(
                f"task {task_id} has no valid task to run again",
                task_id=task_id,
                hint="fix the file and submit it anew",
            )
        rec = transition_locked(
            root,
            task_id,
            cur,
            S.queued,
            expect={S.needs_human, S.failed},
            task=None,
            event="retried",
            log={"by": by, "reason": reason},
            outcome=None,
            changes=dict(decision=Decision(action="retried", by=by, at=now_iso(), reason=reason)),
        )
        fsutil.create_exclusive(root.queued_path(task_id), task_json(cur.task))
        return rec


def keepable(path: Path) -> bool:
    """False for a FIFO, socket or device: rejecting it removes it instead of keeping it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True
    return not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode))


def reject_file(root: Root, src: Path, reason: str, *, name: str | None = None) -> Path:
    """Keep an invalid task file in fila/rejected/ beside `<name>.reason`; never delete it.
    A FIFO, socket or device holds no content to keep and must never sit where someone may open
    it: it is removed, and the `.reason` says so."""
    root.rejected_dir.mkdir(parents=True, exist_ok=True)
    dst = root.rejected_dir / (name or src.name)
    if os.path.lexists(dst):
        dst = root.rejected_dir / f"{dst.stem}.{secrets.token_hex(3)}{dst.suffix}"
    if not keepable(src):
        what = untrusted.entry_kind(os.lstat(src).st_mode)
        os.unlink(src)
        fsutil.fsync_dir(src.parent)
        reason = f"{reason.rstrip()}\n{what} holds no content to keep: it was removed"
    else:
        fsutil.durable_rename(src, dst)
    fsutil.atomic_write(dst.with_name(dst.name + ".reason"), reason.rstrip() + "\n")
    return dst
