"""Recovery of one task's record against its files (fila/in/, fila/run/) and its event log: a
queued record without its file, a running one without a claim, a second copy of the task, a lost
event, a backoff from a clock that went back (docs/architecture.md, the queue's contract)."""

from __future__ import annotations

import json
import os
import time

from ..core import fsutil
from ..core.errors import RecordMismatch
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Record, Status, now_iso
from ..queue import retry
from ..queue import store as queue
from .base import Engine, Report, settle
from .settled import Settled

S = Status


def settle_task(
    root: Root,
    tid: str,
    dk: Engine,
    rep: Report,
    settled: Settled | None = None,
    *,
    listed: bool = True,
) -> None:
    """Record versus files, under the record lock. The in/ file is looked at before run/: a
    claim only moves a file from in/ to run/, so a file seen in neither place is really gone.
    `settled` notes a task that needs nothing (what the next pass may skip); `listed`: its
    record was in the listing of fila/out/ (one that does not parse is passed over, unless a
    file in fila/in/ names it)."""
    with queue.locked(root, tid):
        if settled is not None:
            settled.forget(tid)
        in_file = root.queued_path(tid)
        has_file = os.path.lexists(in_file)  # a dangling symlink dropped there is a file too
        try:
            cur = queue.read_record(root, tid)
        except RecordMismatch as e:
            # Acting on it would settle another task's record under this id (and take this
            # task's own file in fila/in/ for a second copy): a person decides.
            rep.add(root, tid, "record mismatch", f"{e}; nothing was done to either task")
            return
        except ValueError:
            if listed and not has_file:
                return  # nothing to settle from a record that does not parse
            raise
        has_claim = bool(queue.claim_files(root, tid))
        if cur is None:
            return
        _reconcile_events(root, cur, rep)
        cur = _clamp_backoff(root, cur, rep)
        quiet = (
            (cur.status == S.queued and (has_file or has_claim))
            or (cur.status == S.running and has_claim and not has_file)
            or (cur.status not in (S.queued, S.running) and not has_file)
        )
        if quiet:
            if settled is not None:
                settled.note(tid)
            return
        if cur.status == S.queued:
            if not has_file and not has_claim:
                fsutil.create_exclusive(in_file, queue.task_json(cur.task))  # type: ignore[arg-type]
                rep.add(
                    root,
                    tid,
                    "file restored",
                    "the record said queued but the task file "
                    "was missing (a submit or retry was interrupted); written from the record",
                )
            return
        if cur.status == S.running and not has_claim:
            if has_file or not cur.container_started:
                if not has_file:
                    fsutil.create_exclusive(in_file, queue.task_json(cur.task))  # type: ignore[arg-type]
                settle(
                    root,
                    tid,
                    cur,
                    S.queued,
                    error=ErrorInfo(
                        kind=ErrorKind.infra,
                        message=(
                            "a hand back was interrupted"
                            if has_file
                            else "the task was running without any claim"
                        ),
                    ),
                    not_before=None,
                )
                rep.add(
                    root,
                    tid,
                    "requeued",
                    "the record said running but no worker held it; its container had not started",
                )
                return
            removed, seen, gone = dk.job_containers(root, tid)
            rep.containers_removed += removed
            if not gone:
                rep.add(
                    root,
                    tid,
                    "undecided",
                    f"running with a started container and no claim: "
                    f"{seen}; decided once Docker confirms its container is gone",
                )
                return
            settle(
                root,
                tid,
                cur,
                S.needs_human,
                error=ErrorInfo(kind=ErrorKind.interrupted, message="no claim was found"),
                diagnosis=f"the record said running, its container had started, and no "
                f"worker held the task. `fila retry {tid}` or `fila reject {tid}`.",
            )
            rep.add(
                root,
                tid,
                "needs_human",
                "running with a started container and no claim",
            )
            return
        if has_file and cur.status != S.running:
            kept = queue.reject_file(
                root,
                in_file,
                f"task {tid} is already {cur.status}: this file is a second copy",
                name=f"{tid}.json",
            )
            rep.add(
                root,
                tid,
                "duplicate kept aside",
                f"a second file for a {cur.status} task; kept as {kept}",
            )
        elif has_file and has_claim:
            kept = queue.reject_file(
                root,
                in_file,
                f"task {tid} is running: this file is a second copy",
                name=f"{tid}.json",
            )
            rep.add(
                root,
                tid,
                "duplicate kept aside",
                f"a second file for a running task; kept as {kept}",
            )


def _clamp_backoff(root: Root, cur: Record, rep: Report) -> Record:
    """A backoff lasts at most the retry policy's cap (queue/retry.py), so a `not_before` further
    ahead than that comes from a clock that went back after it was written (or a hand edit): left
    as it is, no worker would claim the task, and `run --once` would wait, until the clock caught
    up. Clamped to now + the cap (under the record lock the caller holds)."""
    cap = retry.INFRA.cap
    now = time.time()
    if cur.status != S.queued or cur.not_before is None or cur.not_before <= now + cap:
        return cur
    was, to = cur.not_before, now + cap
    new = cur.model_copy(update={"not_before": to, "updated_at": now_iso()})
    fsutil.atomic_write(root.record_path(cur.id), new.to_json())
    rep.add(
        root,
        cur.id,
        "backoff clamped",
        f"its backoff ended {was - now:.0f} s from now, beyond the {cap:g} s a backoff "
        f"lasts (a clock that went back, or an edit): it now ends in {cap:g} s",
        not_before=was,
        clamped_to=to,
    )
    return new


def _last_status_event(root: Root, tid: str) -> tuple[bool, str | None]:
    """(found, `to`) of the last event in the task's log that records a status change. Lines
    that do not parse (a torn append) are skipped. Reads the tail first: logs only grow."""
    tail = 1 << 16
    try:
        with open(root.events_path(tid), "rb") as f:
            size = f.seek(0, os.SEEK_END)
            while True:
                start = max(0, size - tail)
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines()
                if start > 0:
                    lines = lines[1:]  # the first line may be cut
                for line in reversed(lines):
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(ev, dict) and "to" in ev:
                        return True, ev["to"]
                if start == 0:
                    return False, None
                tail = size  # no status change in the tail: read the whole log
    except FileNotFoundError:
        return False, None


def _reconcile_events(root: Root, cur: Record, rep: Report) -> None:
    """A status change writes the record, then appends its event (under the record lock, which
    the caller holds): a crash between the two loses the event. When the log's last status
    event does not end where the record is, say so in the log."""
    found, last_to = _last_status_event(root, cur.id)
    if found and last_to == str(cur.status):
        return
    rep.add(
        root,
        cur.id,
        "event lost",
        f"the record says {cur.status} but the log's last status "
        f"change ends at {last_to or 'nothing'}: a crash came between the record write and "
        "its event",
        **{"from": last_to, "to": str(cur.status)},
    )
