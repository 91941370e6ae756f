"""Recovery of claims (docs/architecture.md, the queue's contract): a stale claim is reaped by
renaming it to `.reaped` (the race with its worker's `.done`), then requeued when its container
had not started, or decided `needs_human` with what work/ holds as evidence once the container is
confirmed gone; a dead worker's `.done` has its pending result published."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import FilaError, InfraError
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Record, Status
from ..queue import lease, retry
from ..queue import store as queue
from .base import Engine, Report, settle

S = Status


def settle_claim(
    root: Root,
    claim: queue.Claim,
    suffix: str,
    ttl: float,
    alive: lease.AliveFn | None,
    dk: Engine,
    rep: Report,
) -> None:
    if suffix == "reaped":  # a recovery was killed after winning: we hold the recovery lock now
        _settle_reaped(
            root,
            claim,
            "reaped by an earlier recovery that was interrupted or could "
            "not make sure its container was gone",
            None,
            dk,
            rep,
        )
        return
    if suffix not in ("json", "done"):
        return
    path = claim.tombstone(suffix)
    why = lease.stale_reason(root, path, claim.worker, ttl=ttl, alive=alive)
    if why is None:
        return
    if suffix == "done":
        _finish_done(root, claim, why, rep)
        return
    last_beat = lease.heartbeat_age(path)
    if not queue.win(claim, "reaped"):
        return  # the worker completed meanwhile, or handed the task back
    rep.add(root, claim.task_id, "reaped", why, claim=claim.name)
    _settle_reaped(root, claim, why, last_beat, dk, rep)


def _settle_reaped(
    root: Root,
    claim: queue.Claim,
    why: str,
    last_beat: float | None,
    dk: Engine,
    rep: Report,
) -> None:
    """Decide a reaped claim. After the rename its worker can no longer write the record (its
    fence fails), so what we read now is final; the guards below re-check it under the lock."""
    tid, tomb = claim.task_id, claim.tombstone("reaped")
    rec = queue.read_record(root, tid)
    mine = rec is not None and rec.status == S.running and rec.worker == claim.worker
    if rec is None or rec.status == S.queued:
        queue.hand_back(root, claim, suffix="reaped", log={"reason": f"never begun: {why}"})
        rep.add(root, tid, "requeued", f"claimed but never begun; back in fila/in/ ({why})")
        return
    if not mine and rec.worker == claim.worker and rec.status in (S.needs_human, S.failed):
        # A recovery was killed after deciding, before dropping the tombstone.
        with contextlib.suppress(FileNotFoundError):
            tomb.unlink()
        rep.add(
            root,
            tid,
            "tombstone removed",
            f"{tomb.name}: already decided ({rec.status})",
        )
        return
    if not mine:
        _reject(root, tomb, tid, f"a second file for task {tid}, which is {rec.status}", rep)
        return
    assert rec is not None
    if not rec.container_started:
        tries = retry.INFRA.tries(rec) + 1
        removed, _seen, _gone = dk.job_containers(root, tid) if dk.enabled else ([], "", False)
        rep.containers_removed += removed
        err = ErrorInfo(
            kind=ErrorKind.infra,
            message=f"the worker was lost before the container started: {why}",
        )
        if retry.INFRA.gives_up(tries):
            _decide(
                root,
                claim,
                S.failed,
                rep,
                error=ErrorInfo(
                    kind=ErrorKind.infra,
                    message=f"{err.message} (gave up after {tries} attempts)",
                ),
            )
            return
        if queue.hand_back(
            root,
            claim,
            suffix="reaped",
            error=err,
            outcome="lost",
            not_before=time.time() + retry.INFRA.backoff(tries),
            event="recovered",
        ):
            rep.add(
                root,
                tid,
                "requeued",
                f"its container had not started; attempt {tries} of {retry.INFRA.attempts} ({why})",
            )
        return
    removed, seen, gone = dk.job_containers(root, tid)
    rep.containers_removed += removed
    if not gone:
        # Never decide while the container may still exist: its worker may be frozen, not dead,
        # and would start the engine after a person decided. The tombstone stays (the worker is
        # fenced off, `fila retry` refuses) and a later pass decides once Docker confirms.
        rep.add(
            root,
            tid,
            "undecided",
            f"{seen}; {tomb.name} is kept and the task is decided "
            "once Docker confirms its container is gone (run `fila recover` again)",
        )
        return
    evidence, work = _work_evidence(root, rec)
    # A running record carries an error only when its run failed and the cycle kept the task
    # fenced because the container could not be removed (run/claimed.py, JobRun.fence_off: `begin`
    # clears `error`): that failure, not a lost worker, is what a person must read.
    lost = f"the worker was lost while the container ran: {why}"
    failed = rec.error.message if rec.error is not None else None
    what = f"its run failed and its container could not be removed then: {failed}" if failed else lost
    diagnosis = (
        f"{what[0].upper()}{what[1:]}. "
        f"{_how_long(rec, last_beat)} {seen[0].upper()}{seen[1:]}. {work} Nothing was "
        f"run again: `fila retry {tid}` runs it from a clean copy, `fila reject {tid}` "
        "drops it."
    )
    _decide(
        root,
        claim,
        S.needs_human,
        rep,
        diagnosis=diagnosis,
        **evidence,
        error=ErrorInfo(kind=ErrorKind.infra, message=what)
        if failed
        else ErrorInfo(kind=ErrorKind.interrupted, message=lost),
    )


def _how_long(rec: Record, last_beat: float | None) -> str:
    from datetime import datetime

    started = rec.attempts[-1].started_at if rec.attempts else None
    if not started:
        return f"Attempt {rec.attempt}."
    text = f"Attempt {rec.attempt} began at {started}"
    if last_beat is not None:
        ran = time.time() - last_beat - datetime.fromisoformat(started).timestamp()
        text += (
            f" and ran for about {max(0.0, ran):.0f} s until its last heartbeat, "
            f"{last_beat:.0f} s before recovery"
        )
    return text + "."


def _decide(root: Root, claim: queue.Claim, to: Status, rep: Report, **fields: Any) -> None:
    """Write the final state of a reaped claim, then drop the tombstone (the record holds the
    task, so `fila retry` can write the file again)."""
    tid, tomb = claim.task_id, claim.tombstone("reaped")
    with queue.locked(root, tid):
        cur = queue.read_record(root, tid)
        if tomb.exists() and cur is not None and cur.status == S.running and cur.worker == claim.worker:
            settle(root, tid, cur, to, **fields)
            rep.add(root, tid, str(to), fields.get("diagnosis") or fields["error"].message)
        with contextlib.suppress(FileNotFoundError):
            tomb.unlink()
            fsutil.fsync_dir(tomb.parent)


def _work_evidence(root: Root, rec: Record) -> tuple[dict[str, Any], str]:
    """What work/ holds, as DIFF.patch evidence when it can be read safely."""
    from ..engines import get_engine, scanner_for
    from ..queue.policy import load_policy
    from ..workspace import diff, overlay, secretscan

    job = root.job_dir(rec.id)
    if not (job / "input").is_dir() or not (job / "work").is_dir():
        return {}, "There is no job directory to read."
    try:
        policy = load_policy(root, rec.task.policy if rec.task else "default")[0]
        # The dead run's credentials stay out of the evidence as they would have out of its diff.
        scanner = (
            scanner_for(get_engine(rec.engine), rec.task, policy)
            if rec.engine and rec.task is not None
            else secretscan.Scanner(secretscan.known(policy))
        )
        with lease.job_lock(root, rec.id):
            ov = overlay.job_overlay(root, rec.id)  # the overlay strategy: work/ is its layers
            d = diff.compute_diff(job, policy=policy, scratch=root.meta(rec.id) / "scratch",
                                  layers=ov.layers() if ov is not None else None,
                                  credentials=scanner)  # fmt: skip
    except InfraError:
        return {}, "work/ is still in use by a stalled worker and was not read."
    except (FilaError, OSError) as e:
        return {}, f"work/ could not be compared with input/: {e}."
    st = d.stat
    what = (
        f"work/ holds {st.files} changed file(s) (+{st.insertions} -{st.deletions}), "
        f"kept in {d.patch_path.relative_to(root.path)} as evidence."
        if st.files
        else "work/ holds no change."
    )
    found: dict[str, Any] = {}
    if d.credentials is not None:
        found = {"credentials_in_diff": scanner.scrub(d.credentials)}
        what += " " + secretscan.diff_warning(d.credentials.counts, len(d.credentials.files))
    return {
        "diffstat": scanner.scrub(d.stat),
        "patch_sha256": d.sha256,
        "patch_path": str(d.patch_path.relative_to(root.path)),
        **found,
    }, what


def _finish_done(root: Root, claim: queue.Claim, why: str, rep: Report) -> None:
    """A worker won the race and died before (or after) writing its record: publish its
    pending result, which it wrote before the race."""
    tid = claim.task_id
    try:
        pending = json.loads(queue.result_path(root, claim).read_text())
    except (FileNotFoundError, ValueError):
        pending = None
    rec = queue.read_record(root, tid)
    ours = rec is not None and rec.status == S.running and rec.worker == claim.worker
    if ours and pending is not None and pending.get("attempt") != rec.attempt:  # type: ignore[union-attr]
        ours = False  # a tombstone of an earlier attempt of the same worker: only tidy it
    if ours:
        assert rec is not None
        if pending and pending.get("claim") == claim.name:
            new = queue.finish_done(
                root,
                claim,
                Status(pending["status"]),
                pending["fields"],
                attempt=rec.attempt,
                log={"recovered": f"published its pending result ({why})"},
            )
            rep.add(
                root,
                tid,
                f"published {new.status if new else '?'}",
                f"the worker won the race, then was lost; its result was published ({why})",
            )
        else:
            with queue.locked(root, tid):
                cur = queue.read_record(root, tid)
                if (
                    claim.tombstone("done").exists()
                    and cur is not None
                    and cur.status == S.running
                    and cur.worker == claim.worker
                ):
                    settle(
                        root,
                        tid,
                        cur,
                        S.needs_human,
                        error=ErrorInfo(kind=ErrorKind.interrupted, message="the result was lost"),
                        diagnosis=f"Worker {claim.worker} finished but its pending result "
                        f"is missing ({why}). `fila retry {tid}` or `fila reject`.",
                    )
                    rep.add(
                        root,
                        tid,
                        "needs_human",
                        "the worker's pending result is missing",
                    )
    else:
        rep.add(
            root,
            tid,
            "tombstone removed",
            f"{claim.name}.done: the record was written "
            f"({rec.status if rec else 'no record'}); the worker was lost before tidying up",
        )
    queue.release(root, claim, "done")


def _reject(root: Root, src: Path, tid: str, reason: str, rep: Report) -> None:
    with queue.locked(root, tid), contextlib.suppress(FileNotFoundError):
        kept = queue.reject_file(root, src, reason, name=f"{tid}.json")
        rep.add(root, tid, "duplicate kept aside", f"{reason}; kept as {kept}")
