"""Recovery (`fila recover`, and in the background of every worker): after a crash, every task
ends in exactly one state, nothing is lost, nothing runs twice without a person deciding.

What it settles, each step an event in the task's log (and in fila/state/recovery.events.jsonl):
- a stale claim (its worker is gone, or its heartbeat is older than the lease TTL): reaped by
  renaming it to `.reaped` (the race with the worker's `.done`), then
  - container not started: back to fila/in/ (attempt counted; failed once the retry policy of
    queue/retry.py gives up),
  - container started: the container is removed, then `needs_human`, with a diagnosis (worker,
    how long it ran, the container as found, what work/ holds, kept as DIFF.patch evidence). Only
    once Docker confirmed no container of the job is left: until then (Docker down, removal
    failed, `--no-docker`) the `.reaped` tombstone stays and a later pass decides, because a
    frozen worker could still start the engine after a person's decision,
  - never begun (record still queued, or a dropped file without a record): back to fila/in/,
  - the record is another claim's or final: the file is a duplicate, kept in fila/rejected/;
- a `.done` tombstone of a dead worker: its outcome is published from result.json;
- a `.reaped` tombstone (a recovery was killed): settled as above;
- a queued record without its file (submit or retry killed between its writes): file rewritten;
- a running record without any claim: requeued (file back from the record) or needs_human
  (after its container is confirmed gone);
- a record whose status differs from the last status change in its log (a crash between the
  record write and its event): an `event lost` event with `from`/`to`;
- a file in fila/in/ whose record is running without a claim: the hand back is completed;
- a file in fila/in/ for a task that is already past queued: a duplicate, kept in fila/rejected/;
- temp files of atomic writes older than the lease TTL;
- fila's containers of this root whose worker holds no claim file of their task: removed;
- a rootless overlay scratch left in sandbox/meta/<id>/ of a task with no claim: emptied (backend).

One recovery at a time per root (a flock); it is safe while workers run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import fsutil
from ..core.errors import EngineUnavailable, FilaError, InfraError, RecordMismatch
from ..core.layout import Root
from ..queue import lease, retry
from ..queue import store as queue

if TYPE_CHECKING:
    from ..sandbox import Backend
from ..core.models import ErrorInfo, ErrorKind, Record, Status, now_iso

S = Status


@dataclass
class Action:
    task_id: str | None
    action: str
    detail: str


@dataclass
class Report:
    actions: list[Action] = field(default_factory=list)
    containers_removed: list[str] = field(default_factory=list)
    docker: str = "not needed"  # the container engine's state (the key predates other backends)
    backend: str = ""  # the backend that answered
    skipped: bool = False

    def add(self, root: Root, task_id: str | None, action: str, detail: str, **data: Any) -> None:
        self.actions.append(Action(task_id, action, detail))
        if task_id is not None:
            queue.log_event(root, task_id, "recovered", action=action, detail=detail, **data)
        with contextlib.suppress(OSError):
            fsutil.append_line(
                root.state_dir / "recovery.events.jsonl",
                json.dumps(
                    {"at": now_iso(), "task": task_id, "action": action, "detail": detail}, default=str
                ),
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "actions": [asdict(a) for a in self.actions],
            "containers_removed": self.containers_removed,
            "docker": self.docker,
            "backend": self.backend,
            "skipped": self.skipped,
        }


class _Engine:
    """The backend, connected on first use; when its engine does not answer, recovery goes on
    without it (and decides nothing that needs it)."""

    def __init__(self, root: Root, backend: Backend | None, enabled: bool) -> None:
        self.root, self.backend, self.enabled = root, backend, enabled
        self.owned = backend is None
        self.error: str | None = None if enabled else "skipped"
        self.used = False

    def get(self) -> Backend | None:
        if self.error is not None:
            return None
        if self.backend is None:
            from ..sandbox import get_backend, root_backend

            self.backend = get_backend(root_backend(self.root))
        if not self.used:
            try:
                self.backend.ping()
            except EngineUnavailable as e:
                self.error = f"unavailable: {e.message}"
                return None
            self.used = True
        return self.backend

    def close(self) -> None:
        if self.owned and self.backend is not None:
            self.backend.close()

    def job_containers(self, root: Root, tid: str) -> tuple[list[str], str, bool]:
        """Describe and remove the job's containers: (ids removed, what was found, gone). `gone`
        is True only when the engine answered and no container of the job is left: until then a
        frozen worker may still start its engine, so nothing may be decided."""
        backend = self.get()
        if backend is None:
            why = f"the container engine did not answer, so the container could not be checked ({self.error})"
            return [], why, False
        try:
            seen, removed = [], []
            for box in backend.find(job_id=tid, root=str(root.path)):
                seen.append(box.describe())
                if backend.remove(box):
                    removed.append(box.id)
        except InfraError as e:
            return [], f"{backend.name} failed while checking or removing the container: {e}", False
        if not seen:
            return [], "no container of this job was found", True
        return removed, "container " + "; ".join(seen) + " was found and removed", True


@contextlib.contextmanager
def _recovery_lock(root: Root, wait: bool) -> Iterator[bool]:
    root.state_dir.mkdir(parents=True, exist_ok=True)
    with fsutil.file_lock(root.state_dir / ".recovery.lock", wait=wait) as held:
        yield held


def recover(
    root: Root,
    *,
    backend: Backend | None = None,
    docker: bool = True,
    ttl: float | None = None,
    alive: lease.AliveFn | None = None,
    wait: bool = True,
) -> Report:
    """One recovery pass over the root. `alive` replaces the worker liveness probe (tests)."""
    root.require()
    ttl = lease.lease_ttl() if ttl is None else ttl
    rep = Report()
    with _recovery_lock(root, wait) as got:
        if not got:
            rep.skipped = True
            return rep
        dk = _Engine(root, backend, docker)
        for claim, suffix in queue.claims(root):
            try:
                _settle_claim(root, claim, suffix, ttl, alive, dk, rep)
            except (FilaError, OSError, ValueError) as e:  # one task must not stop the others
                rep.add(root, claim.task_id, "error", f"could not settle {claim.name}: {e}")
        settled = _Settled.load(root, rep)
        records = _record_ids(root)
        queued = {p.stem for p in queue.queued_files(root) if queue.valid_id(p.stem)}
        claimed = {c.task_id for c, _suffix in queue.claims(root)}
        now = time.time()
        for tid in sorted(records | queued):
            try:
                if settled.unchanged(tid, queued=tid in queued, claimed=tid in claimed, now=now):
                    continue
                _settle_task(root, tid, dk, rep, settled, listed=tid in records)
            except (FilaError, OSError, ValueError) as e:
                rep.add(root, tid, "error", f"could not settle: {e}")
        settled.save(root, records)
        _sweep_temp_files(root, ttl, rep)
        _sweep_containers(root, dk, rep)
        _sweep_scratch(root, dk, rep)
        lease.forget_dead_workers(root)
        rep.docker = dk.error or ("ok" if dk.used else "not needed")
        rep.backend = dk.backend.name if dk.used and dk.backend is not None else ""
        dk.close()
    return rep


def _settle_claim(
    root: Root,
    claim: queue.Claim,
    suffix: str,
    ttl: float,
    alive: lease.AliveFn | None,
    dk: _Engine,
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
    root: Root, claim: queue.Claim, why: str, last_beat: float | None, dk: _Engine, rep: Report
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
        rep.add(root, tid, "tombstone removed", f"{tomb.name}: already decided ({rec.status})")
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
            kind=ErrorKind.infra, message=f"the worker was lost before the container started: {why}"
        )
        if retry.INFRA.gives_up(tries):
            _decide(
                root,
                claim,
                S.failed,
                rep,
                error=ErrorInfo(
                    kind=ErrorKind.infra, message=f"{err.message} (gave up after {tries} attempts)"
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
    # fenced because the container could not be removed (cycle._Run.fence_off: `begin` clears
    # `error`): that failure, not a lost worker, is what a person must read.
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


def _settle(root: Root, tid: str, cur: Record, to: Status, **changes: Any) -> None:
    """The one transition recovery makes out of `running` (under the caller's record lock): to
    needs_human, failed or queued, closing the attempt as lost."""
    queue.transition_locked(
        root, tid, cur, to, expect={S.running}, event="recovered", outcome="lost", changes=changes
    )


def _decide(root: Root, claim: queue.Claim, to: Status, rep: Report, **fields: Any) -> None:
    """Write the final state of a reaped claim, then drop the tombstone (the record holds the
    task, so `fila retry` can write the file again)."""
    tid, tomb = claim.task_id, claim.tombstone("reaped")
    with queue.locked(root, tid):
        cur = queue.read_record(root, tid)
        if tomb.exists() and cur is not None and cur.status == S.running and cur.worker == claim.worker:
            _settle(root, tid, cur, to, **fields)
            rep.add(root, tid, str(to), fields.get("diagnosis") or fields["error"].message)
        with contextlib.suppress(FileNotFoundError):
            tomb.unlink()
            fsutil.fsync_dir(tomb.parent)


def _work_evidence(root: Root, rec: Record) -> tuple[dict[str, Any], str]:
    """What work/ holds, as DIFF.patch evidence when it can be read safely."""
    from ..engines import get_engine, scanner_for
    from ..queue.policy import load_policy
    from ..workspace import diff, secretscan, snapshot

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
            ov = snapshot.job_overlay(root, rec.id)  # the overlay strategy: work/ is its layers
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
                    _settle(
                        root,
                        tid,
                        cur,
                        S.needs_human,
                        error=ErrorInfo(kind=ErrorKind.interrupted, message="the result was lost"),
                        diagnosis=f"Worker {claim.worker} finished but its pending result "
                        f"is missing ({why}). `fila retry {tid}` or `fila reject`.",
                    )
                    rep.add(root, tid, "needs_human", "the worker's pending result is missing")
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


def _record_ids(root: Root) -> set[str]:
    """The ids of the records in fila/out/, by name (one directory listing, nothing read)."""
    with os.scandir(root.out_dir) as it:
        names = [e.name for e in it if e.name.endswith(".json") and not e.name.startswith(".")]
    return {n[: -len(".json")] for n in names if queue.valid_id(n[: -len(".json")])}


class _Settled:
    """What the last passes found needing nothing, so that a pass over a long history reads only
    what changed since (a stat pass and a read of each record's bytes, not a lock and a log read
    per task): per task id, the sha256 of the record's bytes, and its event log's inode, size,
    mtime_ns and ctime_ns, noted under the record lock when `_settle_task` found the record and
    its files agreeing. Any write to the record changes its bytes; any write to the log, an
    append or an edit in place of the same size, sets its ctime, which no user can set back
    (mtime alone can be); so an unchanged entry means nothing since then has left anything in
    between to reconcile. The files around it (fila/in/,
    fila/run/) are looked at in every pass, against the status in the record's own bytes (which
    the digest binds), never a status the cache states.

    The file is only a hint, which whoever can write fila/state/ could forge: it is read with
    O_NOFOLLOW and ignored unless it is a regular file of fila's uid that no one else may write;
    an entry of any other shape is a miss; unreadable or lost, the next pass reads everything."""

    VERSION = 2
    _HEX = "0123456789abcdef"
    _STATUSES = frozenset(str(s) for s in S)

    def __init__(self, root: Root, entries: dict[str, list[Any]], *, changed: bool = False) -> None:
        self.entries = entries
        self.changed = changed  # True: what is on disk is not ours and is replaced
        self.out, self.logs = str(root.out_dir), str(root.logs_dir)

    @staticmethod
    def path(root: Root) -> Path:
        return root.state_dir / "recovery.settled.json"

    @classmethod
    def load(cls, root: Root, rep: Report) -> _Settled:
        from ..core.stored import NotTrusted, owned_bytes

        try:
            data = json.loads(owned_bytes(str(cls.path(root)), os.geteuid()))
        except FileNotFoundError:
            return cls(root, {})
        except NotTrusted as e:
            return cls._ignored(root, rep, str(e))
        except (OSError, ValueError, RecursionError):
            return cls(root, {}, changed=True)
        if not (
            isinstance(data, dict) and data.get("v") == cls.VERSION and isinstance(data.get("entries"), dict)
        ):
            return cls(root, {}, changed=True)
        entries = {k: v for k, v in data["entries"].items() if queue.valid_id(k) and cls._well_formed(v)}
        return cls(root, entries, changed=len(entries) != len(data["entries"]))

    @classmethod
    def _ignored(cls, root: Root, rep: Report, why: str) -> _Settled:
        rep.add(root, None, "cache ignored", f"{cls.path(root)}: {why}; this pass reads every record")
        return cls(root, {}, changed=True)

    @classmethod
    def _well_formed(cls, e: Any) -> bool:
        """[64 hex digits, null | [inode, size, mtime_ns, ctime_ns]]."""
        if not (isinstance(e, list) and len(e) == 2):
            return False
        digest, log = e
        if not (isinstance(digest, str) and len(digest) == 64 and not digest.strip(cls._HEX)):
            return False
        return log is None or (
            isinstance(log, list) and len(log) == 4 and all(type(n) is int and n >= 0 for n in log)
        )

    def _seen(self, tid: str) -> tuple[list[Any], bytes] | None:
        """([sha256 of the record, the log's [inode, size, mtime_ns, ctime_ns] or None], the
        record's bytes), or None when the record cannot be read."""
        try:
            with open(f"{self.out}/{tid}.json", "rb") as f:
                data = f.read()
            log: list[int] | None = None
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(f"{self.logs}/{tid}.events.jsonl")
                log = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        except OSError:
            return None
        return [hashlib.sha256(data).hexdigest(), log], data

    def unchanged(self, tid: str, *, queued: bool, claimed: bool, now: float) -> bool:
        """True when the record and its log are as a pass left them agreeing, and the files
        around it still agree with the status its own bytes state: a final record has no file in
        fila/in/ (a second copy), a queued one has its file (or a claim) and no backoff beyond
        the cap, a running one its claim and no file. Anything else, or any doubt, is a miss."""
        hit = self.entries.get(tid)
        if hit is None:
            return False
        seen = self._seen(tid)
        if seen is None or seen[0] != hit:
            return False
        try:
            rec = json.loads(seen[1])
        except (ValueError, RecursionError):
            return False
        if not isinstance(rec, dict) or rec.get("id") != tid:
            return False
        status, not_before = rec.get("status"), rec.get("not_before")
        if status == S.queued:
            late = isinstance(not_before, (int, float)) and not_before > now + retry.INFRA.cap
            return (queued or claimed) and not late
        if status == S.running:
            return claimed and not queued
        return status in self._STATUSES and not queued

    def note(self, tid: str) -> None:
        """Under the record lock, after `_settle_task` found nothing to do for it."""
        seen = self._seen(tid)
        if seen is not None:
            self.entries[tid] = seen[0]
            self.changed = True

    def forget(self, tid: str) -> None:
        if self.entries.pop(tid, None) is not None:
            self.changed = True

    def save(self, root: Root, records: set[str]) -> None:
        gone = set(self.entries) - records
        for tid in gone:
            del self.entries[tid]
        if not (self.changed or gone):
            return
        data = json.dumps({"v": self.VERSION, "entries": self.entries}, separators=(",", ":"))
        # fsutil's write: a temp file of an unpredictable name made with O_EXCL (a link planted
        # in fila/state/ is never written through), mode 0644, renamed over whatever is there.
        with contextlib.suppress(OSError):
            fsutil.atomic_write(self.path(root), data, mode=0o644)


def _settle_task(
    root: Root, tid: str, dk: _Engine, rep: Report, settled: _Settled | None = None, *, listed: bool = True
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
                _settle(
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
            _settle(
                root,
                tid,
                cur,
                S.needs_human,
                error=ErrorInfo(kind=ErrorKind.interrupted, message="no claim was found"),
                diagnosis=f"the record said running, its container had started, and no "
                f"worker held the task. `fila retry {tid}` or `fila reject {tid}`.",
            )
            rep.add(root, tid, "needs_human", "running with a started container and no claim")
            return
        if has_file and cur.status != S.running:
            kept = queue.reject_file(
                root,
                in_file,
                f"task {tid} is already {cur.status}: this file is a second copy",
                name=f"{tid}.json",
            )
            rep.add(
                root, tid, "duplicate kept aside", f"a second file for a {cur.status} task; kept as {kept}"
            )
        elif has_file and has_claim:
            kept = queue.reject_file(
                root, in_file, f"task {tid} is running: this file is a second copy", name=f"{tid}.json"
            )
            rep.add(root, tid, "duplicate kept aside", f"a second file for a running task; kept as {kept}")


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


def _sweep_temp_files(root: Root, ttl: float, rep: Report) -> None:
    """Temp files of atomic writes whose writer died (a live writer renames within ms)."""
    now = time.time()
    dirs = [
        root.in_dir,
        root.out_dir,
        root.run_dir,
        root.state_dir,
        root.rejected_dir,
        lease.workers_dir(root),
    ]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(root.meta_dir) as it:
        dirs += [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    for d in dirs:
        # One listing per directory (a glob per directory cost 30 ms over 1,000 jobs' meta).
        try:
            with os.scandir(d) as it:
                temps = [Path(e.path) for e in it if e.name.startswith(".") and e.name.endswith(".tmp")]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for p in temps:
            tid = _task_of_temp(p)
            # A record is only written under its record lock: holding it, any temp file of that
            # record is an interrupted write, however young. Elsewhere, age tells.
            held = queue.locked(root, tid) if tid and d == root.out_dir else None
            with held or contextlib.nullcontext(), contextlib.suppress(FileNotFoundError):
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # fila's temp files are regular files: a directory or FIFO is not one
                if held is not None or now - st.st_mtime > ttl:
                    p.unlink()
                    rep.add(root, tid, "temp file removed", f"{p} (a write was interrupted)")


def _task_of_temp(p: Path) -> str | None:
    """`.<id>.json.<random>.tmp` (fsutil's names) -> id, when it names a task file or record."""
    parts = p.name[1:].split(".json.")
    return (
        parts[0] if len(parts) == 2 and queue.valid_id(parts[0]) and p.parent.name in ("in", "out") else None
    )


def _sweep_containers(root: Root, dk: _Engine, rep: Report) -> None:
    """Remove fila's containers of this root whose worker holds no claim of their task."""
    if not dk.enabled:
        return
    backend = dk.get()
    if backend is None:
        return
    from ..sandbox.base import JOB_LABEL, WORKER_LABEL

    try:
        found = backend.find(root=str(root.path))
    except InfraError as e:
        dk.error = f"listing containers failed: {e.message}"
        return
    for box in found:
        tid = box.labels.get(JOB_LABEL, "")
        # A claim outlives its container (the backend removes the container before the claim is
        # published or handed back), so a container listed before this check whose worker holds
        # no claim file of its task now is left over. A claim that is there, stale or not, is
        # never swept here: only the reaper, after winning the rename race (and with it the
        # right to decide), removes its container. Only that container goes, by id: a new
        # attempt's container of the same task is never touched.
        if not queue.valid_id(tid) or _has_claim(root, tid, box.labels.get(WORKER_LABEL)):
            continue
        try:
            removed = backend.remove(box)
        except InfraError as e:
            rep.add(root, tid, "error", f"could not remove container {box.name}: {e}")
            continue
        if removed:
            rep.containers_removed.append(box.id)
            rep.add(
                root,
                tid,
                "container removed",
                f"{box.name} ({box.status}): no live worker holds its task",
                container=box.name,
            )
    _sweep_egress(root, backend, rep)
    try:  # after the containers: a work volume goes only once no container uses it
        swept = backend.sweep_volumes(str(root.path))
    except InfraError as e:
        rep.add(root, None, "error", f"could not sweep fila's volumes: {e}")
        return
    for name, tid in swept:
        job = tid if tid is not None and queue.valid_id(tid) else None
        rep.add(root, job, "volume removed", f"{name}: no container used it (its removal was cut short)")


def _sweep_scratch(root: Root, dk: _Engine, rep: Report) -> None:
    """Rootless overlay scratches of jobs no live worker holds: a worker killed between its
    container's removal and the scratch's leaves one with no container for the sweep above to
    find, and nothing else could remove it (gc's rm neither). After the claims are settled, a
    claim file still there is a live worker's: its scratch is kept (gc.clear_scratch)."""
    if not dk.enabled:
        return
    from .gc import clear_scratch, scratch_left

    try:
        names = sorted(os.listdir(root.meta_dir))
    except FileNotFoundError:
        return
    for tid in names:
        if not queue.valid_id(tid) or not scratch_left(root, tid):
            continue
        backend = dk.get()  # only when one is left: a recovery pass connects to nothing otherwise
        if backend is None:
            return
        try:
            cleared = clear_scratch(root, tid, backend)
        except (FilaError, OSError) as e:
            rep.add(root, tid, "error", f"could not clear the overlay scratch: {e}")
            continue
        if cleared:
            rep.add(root, tid, "scratch cleared", "the overlay scratch of a job no live worker holds")


def _sweep_egress(root: Root, backend: Backend, rep: Report) -> None:
    """Job networks and gateway directories (secrets) of jobs no live worker holds: after the
    containers, so their gateways are gone and the networks can be removed."""
    try:
        removed = backend.sweep_egress(
            root.path, root.meta_dir, lambda tid, worker: _has_claim(root, tid, worker)
        )
    except (InfraError, OSError) as e:
        rep.add(root, None, "error", f"could not sweep job networks or gateway directories: {e}")
        return
    for what in removed:
        rep.add(root, None, "egress removed", f"{what}: no live worker holds its task")


def _has_claim(root: Root, tid: str, worker: str | None) -> bool:
    """Any claim or tombstone (.json, .done, .reaped) of the task, of `worker` when known."""
    for p in queue.claim_files(root, tid):
        parsed = queue.parse_claim(p)
        if parsed is None or worker is None or parsed[0].worker == worker:
            return True
    return False
