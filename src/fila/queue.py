"""The file queue and its one state machine (queue-contract.md).

Where a task is:
    fila/in/<id>.json                 queued (the task file; a person or CI may drop one here)
    fila/run/<id>~<worker>.json       claimed: owned by <worker>; its mtime is the heartbeat
    fila/run/<id>~<worker>.done       the worker won the completion race and is publishing
    fila/run/<id>~<worker>.reaped     recovery won the race against a dead worker
    fila/out/<id>.json                the record: status and history, written only by set_status
    fila/logs/<id>.events.jsonl       every event, appended

Every ownership change is one rename of the one claim file, so a worker completing and a reaper
expiring its lease race on the same rename: exactly one wins, and the loser never publishes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import fsutil
from .errors import DuplicateId, InvalidTransition, NotFound
from .layout import Root, check_id
from .models import Record, Status, Task, now_iso, valid_id

S = Status
# queue-contract.md, "Transitions". A running -> running change is a checkpoint or a fallback.
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
CLAIM_SEP = "~"


def new_worker_id() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{secrets.token_hex(2)}"


def new_task_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


# -- records and events ---------------------------------------------------------------------


def read_record(root: Root, task_id: str) -> Record | None:
    try:
        data = root.record_path(task_id).read_bytes()
    except FileNotFoundError:
        return None
    return Record.model_validate_json(data)


def get_record(root: Root, task_id: str) -> Record:
    rec = read_record(root, task_id)
    if rec is None:
        raise NotFound(f"no task {task_id!r} in {root.out_dir}", hint="`fila ls` lists tasks")
    return rec


def log_event(root: Root, task_id: str, event: str, **data: Any) -> None:
    line = json.dumps({"at": now_iso(), "event": event, **data}, default=str, sort_keys=False)
    fsutil.append_line(root.events_path(task_id), line)


def read_events(root: Root, task_id: str) -> list[dict[str, Any]]:
    try:
        lines = root.events_path(task_id).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


@contextlib.contextmanager
def _record_lock(root: Root, task_id: str) -> Iterator[None]:
    # Serialises read-check-write of one record between processes on this host (two people
    # deciding at once, a worker and `fila recover`). Ownership itself is the claim rename.
    fd = os.open(root.out_dir / f".{task_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def set_status(
    root: Root,
    task_id: str,
    to: Status,
    *,
    expect: set[Status] | None = None,
    task: Task | None = None,
    event: str | None = None,
    **changes: Any,
) -> Record:
    """The one function that changes a task's status (and the only writer of its record).

    Checks the transition against ALLOWED (and `expect`, the states the caller believes the task
    is in), validates the whole new record, writes it atomically and durably, then appends an
    event. A refused change raises InvalidTransition and writes nothing.
    """
    check_id(task_id)
    with _record_lock(root, task_id):
        cur = read_record(root, task_id)
        frm = cur.status if cur else None
        if to not in ALLOWED[frm] or (expect is not None and frm not in expect):
            raise InvalidTransition(
                f"task {task_id} is {frm or 'unknown'}; it cannot become {to}",
                task_id=task_id,
                hint="`fila show ID` shows its state and history",
            )
        if cur is None:
            base: dict[str, Any] = {"id": task_id, "task": task}
            if task is not None:
                base.update(engine=task.engine, model=task.model)
        else:
            base = cur.model_dump()
        base.update(changes)
        base.update(status=to, updated_at=now_iso())
        new = Record.model_validate(base)
        path = root.record_path(task_id)
        if cur is None:
            if not fsutil.create_exclusive(path, new.to_json()):
                raise DuplicateId(f"task id {task_id!r} exists already", task_id=task_id)
        else:
            fsutil.atomic_write(path, new.to_json())
        summary = {k: v for k, v in changes.items() if k in {"attempt", "worker", "exit_code"}}
        if new.error and to in {S.failed, S.needs_human, S.queued}:
            summary["error"] = new.error.model_dump(mode="json")
        log_event(root, task_id, event or "status", **{"from": frm, "to": to}, **summary)
        return new


# -- submit and claim ------------------------------------------------------------------------


def id_in_use(root: Root, task_id: str) -> str | None:
    """Where the id exists already, or None. Idempotency: such an id is refused at submit."""
    places = [
        root.queued_path(task_id), root.record_path(task_id), root.job_dir(task_id),
        root.rejected_dir / f"{task_id}.json",
    ]
    for p in places:
        if p.exists() or p.is_symlink():
            return str(p)
    if any(root.run_dir.glob(f"{task_id}{CLAIM_SEP}*")):
        return str(root.run_dir)
    return None


def enqueue(root: Root, task_id: str, task: Task) -> Record:
    """Queue a validated task: the record first (it reserves the id), then `in/<id>.json`.

    A crash between the two leaves a queued record without its file; recovery writes the file
    again from the record, which holds the whole task.
    """
    where = id_in_use(root, task_id)
    if where:
        raise DuplicateId(
            f"task id {task_id!r} exists already ({where})",
            task_id=task_id,
            hint="choose another id, or omit it to get a new one",
        )
    task = task.model_copy(update={"id": task_id})
    rec = set_status(root, task_id, S.queued, task=task, event="submitted")
    if not fsutil.create_exclusive(root.queued_path(task_id), _task_json(task)):
        raise DuplicateId(f"task file {root.queued_path(task_id)} appeared meanwhile")
    return rec


def _task_json(task: Task) -> str:
    return task.model_dump_json(indent=2, exclude_none=True) + "\n"


def queued_files(root: Root) -> list[Path]:
    """Task files waiting in in/, oldest first. Hidden and temporary files are not tasks."""
    out = []
    with os.scandir(root.in_dir) as it:
        for e in it:
            if e.name.startswith(".") or not e.name.endswith(".json"):
                continue
            with contextlib.suppress(FileNotFoundError):
                out.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name, Path(e.path)))
    return [p for _, _, p in sorted(out)]


@dataclass(frozen=True)
class Claim:
    task_id: str
    worker: str
    path: Path

    def tombstone(self, suffix: str) -> Path:
        return self.path.with_suffix(suffix)


def claim_path(root: Root, task_id: str, worker: str) -> Path:
    return root.run_dir / f"{task_id}{CLAIM_SEP}{worker}.json"


def try_claim(root: Root, src: Path, worker: str) -> Claim | None:
    """Claim one queued file by renaming it into run/: exactly one worker's rename succeeds."""
    task_id = src.stem
    if not valid_id(task_id):
        return None
    dst = claim_path(root, task_id, worker)
    try:
        fsutil.durable_rename(src, dst)
    except FileNotFoundError:
        return None  # another worker won
    log_event(root, task_id, "claimed", worker=worker)
    return Claim(task_id, worker, dst)


def heartbeat(claim: Claim) -> bool:
    """Refresh the lease; False when it is gone (reaped), so the worker must not publish."""
    try:
        os.utime(claim.path)
        return True
    except FileNotFoundError:
        return False


def parse_claim(path: Path) -> tuple[str, str, str] | None:
    """`<id>~<worker>.<json|done|reaped>` -> (id, worker, suffix)."""
    stem, dot, suffix = path.name.rpartition(".")
    task_id, sep, worker = stem.partition(CLAIM_SEP)
    if not dot or not sep or not valid_id(task_id):
        return None
    return task_id, worker, suffix


def claims(root: Root) -> list[tuple[str, str, str, Path]]:
    out = []
    for p in sorted(root.run_dir.iterdir()):
        parsed = parse_claim(p)
        if parsed:
            out.append((*parsed, p))
    return out


def win(claim: Claim, suffix: str) -> bool:
    """Take final ownership of a claim (worker: 'done'; reaper: 'reaped'). One rename, one winner."""
    try:
        fsutil.durable_rename(claim.path, claim.tombstone("." + suffix))
        return True
    except FileNotFoundError:
        return False


def release(claim: Claim, suffix: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(claim.tombstone("." + suffix))


def hand_back(root: Root, claim: Claim) -> bool:
    """Give a claimed task back to in/ (before its container started). False if the lease is gone."""
    try:
        fsutil.durable_rename(claim.path, root.queued_path(claim.task_id))
        return True
    except FileNotFoundError:
        return False


def reject_file(root: Root, src: Path, reason: str, *, name: str | None = None) -> Path:
    """Keep an invalid task file in fila/rejected/ beside `<name>.reason`; never delete it."""
    root.rejected_dir.mkdir(parents=True, exist_ok=True)
    dst = root.rejected_dir / (name or src.name)
    if dst.exists():
        dst = root.rejected_dir / f"{dst.stem}.{secrets.token_hex(3)}{dst.suffix}"
    fsutil.durable_rename(src, dst)
    fsutil.atomic_write(dst.with_name(dst.name + ".reason"), reason.rstrip() + "\n")
    return dst


def all_records(root: Root) -> list[Record]:
    recs = []
    for p in sorted(root.out_dir.glob("*.json")):
        if p.name.startswith("."):
            continue
        with contextlib.suppress(FileNotFoundError, ValueError):
            recs.append(Record.model_validate_json(p.read_bytes()))
    return recs
