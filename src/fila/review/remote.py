"""Review from anywhere (docs/scale-out.md): the decision on a task of a PostgreSQL queue, taken
from the reviewer's own queue root with the same checks as on the file queue.

The task's job directory stays on its runner. `apply` lays out in the reviewer's root what
review/apply.py reads, each piece checked on its way out of the database: `sandbox/jobs/<id>/
input` from the task's input manifest and blobs (each against its sha256 and size),
`DIFF.patch` from its blob (against the sha256 the record names), `work/` as input/ with that
patch applied (the runner's work/ does not travel; the patch's sha256 is what ties the review to
what lands), and `sandbox/meta/<id>/manifest.json` naming the reviewer's root as the project.
apply then runs its recipe unchanged: the paths' checks, moved base against the reviewer's
files or `--3way`, the landing and its marker (an interrupted apply is finished by running it
again). The decision is written to the database (QueueBook), once for everyone: a task another
reviewer decided meanwhile is refused naming who decided, its landing rolled back in this root,
and the copy is removed once the decision is recorded or refused. A compare group's member is
decided with the supersedes of the other members in one transaction (PgQueue.decide_group).

`fila review --queue` and `fila compare --queue` read the same pieces without laying anything
out: report.of on the record and the checked DIFF.patch blob, groups.comparison on the members'
records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import FilaError, InvalidId, InvalidInput, InvalidTransition, NotFound, Refused
from ..core.layout import Root
from ..core.models import Decision, Record, Status, now_iso
from ..core.states import valid_id
from ..provenance.remote import QueueSource
from ..queue.pg.groups import GroupDecision
from ..queue.pg.inputs import check_limits, read_manifest, unpack
from ..queue.pg.store import INPUTS, PgQueue
from ..queue.records import check_group, superseded_by
from ..workspace import jobdir
from ..workspace.fswalk import escape_name
from ..workspace.safedir import SafeDir
from . import attested, decision, groups, landing, patch, report
from .apply import Applied, apply, patch_git, rolled_back

# Written last when the copy is complete: a job directory without it is not this module's.
MARK = "remote.json"


def queued_patch(db: PgQueue, rec: Record) -> bytes:
    """The task's DIFF.patch blob, which must be the patch its record names (sha256)."""
    sha = db.task_blobs(rec.id).get("DIFF.patch")
    if sha is None or not rec.patch_sha256:
        raise NotFound(
            f"task {rec.id} has no DIFF.patch in the queue database {db.where} (status {rec.status})",
            task_id=rec.id,
            hint="`fila show ID --queue URL` tells why; a failed task may have no diff",
        )
    if sha != rec.patch_sha256:
        raise Refused(
            f"task {rec.id}: the DIFF.patch blob is sha256 {sha}, its record names {rec.patch_sha256}",
            task_id=rec.id,
            hint="nothing was written; the database's copy changed after the runner published it",
        )
    return db.blob(sha)  # checked against its sha256 on the way out


def queued_log(db: PgQueue, task_id: str, *, events: bool = False) -> bytes:
    """The engine's log its runner published (the `log` blob, checked against its sha256), or
    with `events` the queue's events of the task as JSON lines. NotFound for an unknown id only:
    a task with no log yet (queued, running, or failed before its engine ran) has an empty one,
    as on the file queue, whose `fila logs` prints what fila/logs holds."""
    db.get(task_id)  # NotFound for an unknown id
    if events:
        return b"".join(json.dumps(e, default=str).encode() + b"\n" for e in db.events(task_id))
    sha = db.task_blobs(task_id).get("log")
    return b"" if sha is None else db.blob(sha)


def review_queued(root: Root, db: PgQueue, task_id: str) -> report.Review:
    """`fila review ID --queue URL`: the file queue's review (review/report.py) of the task's
    record and its DIFF.patch blob, checked against the sha256 its record names and against its
    own (Refused or BlobMismatch: nothing shown). The policy judging it is this root's copy of
    the task's policy (the built-in defaults without one, and the review's warnings say so), and
    the project shown is this root, where `fila apply --queue` would land it."""
    rec = db.get(task_id)
    data = queued_patch(db, rec) if rec.patch_sha256 else None
    here = (root.path / "fila").is_dir()
    project = str(root.path) if here else "(the queue root `fila apply --queue` runs from)"
    note = patch.policy_note(root, rec)
    rv = report.of(rec, patch.policy_for(root, rec), data, project, root=root if here else None,
                   notes=[note] if note else None, project_dir=root.path if here else None)  # fmt: skip
    return report.with_provenance(rv, QueueSource(db))


def review_html(root: Root, db: PgQueue, task_id: str, rv: report.Review, out: Path | None) -> Path:
    """REVIEW.html of a queued task: at `out`, else `<root>/fila/reviews/<task_id>/REVIEW.html`
    (a PostgreSQL queue's task has no job directory on the reviewer's host; this root's fila/ is
    its own, and `fila gc` leaves it). The path is built from the id the person asked for, once
    it is a valid id, never from the database's record; the log's end is the runner's published
    log blob."""
    if not valid_id(task_id):
        raise InvalidId(f"task id {task_id!r} is not [A-Za-z0-9._-]{{1,128}}", task_id=None)
    if out is None:
        out = root.require().fila / "reviews" / task_id / "REVIEW.html"
    tail = queued_log(db, task_id)[-report.LOG_TAIL_BYTES :]
    return report.write_html_at(out, rv, tail)


def decide(db: PgQueue, task_id: str, action: str, *, by: str, reason: str | None) -> Record:
    """The decision written to the database once; a task decided meanwhile (by anyone, from any
    host) is refused naming who decided (decision.check_undecided)."""
    to = Status.applied if action == "apply" else Status.rejected
    made = Decision(action=to.value, by=by, at=now_iso(), reason=reason)
    try:
        return db.decide(task_id, to, made, expect=decision.DECIDABLE[action])
    except InvalidTransition:
        decision.check_undecided(db.get(task_id), action)
        raise


class QueueBook:
    """decision.Book for a PostgreSQL queue: the record from the database (its patch named where
    `apply` finds the copy), events and the decision written there. An `apply` goes through
    PgQueue.decide_group: the decision and the supersedes of the other members of its compare
    group in ONE transaction (what it superseded and left is kept in `group`)."""

    def __init__(self, db: PgQueue) -> None:
        self.db = db
        self.group: GroupDecision | None = None

    def get(self, root: Root, task_id: str) -> Record:
        rec = self.db.get(task_id)
        if not rec.patch_path:
            return rec
        local = (root.job_dir(task_id) / "DIFF.patch").relative_to(root.path)
        return rec.model_copy(update={"patch_path": local.as_posix()})

    def log(self, root: Root, task_id: str, event: str, **data: Any) -> None:
        self.db.note(task_id, event, {**data, "reviewer_root": str(root.path)})

    def decide(self, root: Root, task_id: str, action: str, *, by: str, reason: str | None,
               expect: set[Status]) -> Record:  # fmt: skip
        if action != "apply":
            return decide(self.db, task_id, action, by=by, reason=reason)
        made = Decision(action=Status.applied.value, by=by, at=now_iso(), reason=reason)
        try:
            self.group = self.db.decide_group(
                task_id, made, expect=decision.DECIDABLE["apply"], supersede=decision.DECIDABLE["reject"]
            )
        except InvalidTransition:
            # Superseded or decided meanwhile: say by whom. Still undecided: another member won,
            # and the error raised names it, who and when.
            decision.check_undecided(self.db.get(task_id), action)
            raise
        return self.group.record

    def source(self, root: Root) -> QueueSource:
        """The task's statements and the trusted keys in the database (docs/provenance.md)."""
        return QueueSource(self.db)


def queued_members(db: PgQueue, group: str) -> list[Record]:
    """The group's members in the database, by id; NotFound for a group no task has (a member's
    id given instead is named as such, groups.no_group)."""
    found = db.group_records(group)
    if found:
        return found
    try:
        same = db.get(group)
    except NotFound:
        same = None
    raise groups.no_group(group, same, f" in the queue database {db.where}")


def compare_queued(db: PgQueue, group: str) -> groups.Comparison:
    """`fila compare GROUP --queue URL`: the file queue's table (groups.comparison) from the
    members' records in the database."""
    return groups.comparison(group, queued_members(db, group))


def apply_queued(root: Root, db: PgQueue, task_id: str, **options: Any) -> Applied:
    """`fila apply ID --queue URL`: the task's patch landed in the reviewer's root (its project)
    with apply's checks, the decision recorded in the database. `options` are apply's.

    A member of a compare group: refused before anything is copied when another member was
    applied already; otherwise it lands as any task does, and its decision and the supersedes
    of the other members are one transaction (QueueBook.decide, PgQueue.decide_group), so of
    two reviewers applying two members at once exactly one is recorded; the other is refused
    naming the member that won, and its landing is taken back (apply.rolled_back).

    Run again after an interrupted apply of this root (its marker and copy here): finished as
    the file queue does while the task is undecided; taken back and refused when the task was
    decided since by anyone else (another member won, a reject from another host); finished
    (marker and copy dropped, exit 0) when the database says this decider applied this patch,
    its reply lost (_recorded, _finish). Each database step is its own transaction (db.get,
    group_records, decide_group); the landing and its rollback are files, between them."""
    root.require()
    rec = db.get(task_id)
    who = decision.decider(options.get("by"))
    marker = landing.read_marker(root, task_id) if (root.meta(task_id) / MARK).is_file() else None
    if marker is not None and _recorded(root, rec, marker, who):
        return _finish(root, db, rec, marker)
    try:
        decision.check_undecided(rec, "apply")  # decided elsewhere: refused before anything is copied
        if rec.task is not None and rec.task.group:
            check_group(rec, db.group_records(rec.task.group))
    except FilaError as e:
        if marker is None:
            raise
        # An apply of ours landed here and was cut off before its decision; the task was decided
        # since (another member won, a reject from another host): the landing is taken back.
        err = rolled_back(root, task_id, QueueBook(db), e, who)
        _drop(root, task_id)
        raise err from None
    _lay_out(root, db, rec)
    book = QueueBook(db)
    try:
        res = apply(root, task_id, book=book, **options)
    except BaseException:
        if landing.read_marker(root, task_id) is None:  # nothing landed: no copy left behind
            _drop(root, task_id)
        raise
    _drop(root, task_id)
    if book.group is not None:
        res.superseded, res.undecided = book.group.superseded, book.group.undecided
    return res


def _recorded(root: Root, rec: Record, marker: dict[str, Any], who: str) -> bool:
    """Did this decider's apply of this patch land here and its decision commit, only its reply
    lost (the database says applied by `who`, the marker names the same patch, and every path
    the marker lists holds its state after the patch)?"""
    d = rec.decision
    if rec.status != Status.applied or d is None or d.by != who:
        return False
    if not rec.patch_sha256 or marker.get("patch_sha256") != rec.patch_sha256:
        return False
    with SafeDir(Path(marker["project"])) as proj:
        return all(landing.classify(proj, landing.Op.from_json(x)) == "after" for x in marker["ops"])


def _finish(root: Root, db: PgQueue, rec: Record, marker: dict[str, Any]) -> Applied:
    """The end of an apply whose decision committed and whose reply was lost: the marker and
    the copy go, and what the decision superseded (queue/records.superseded_by: the reason
    names this task) and left undecided is read back from the database."""
    ops = [landing.Op.from_json(x) for x in marker["ops"]]
    landing.clear(root, rec.id)
    _drop(root, rec.id)
    db.note(rec.id, "apply finished", {"by": rec.decision.by if rec.decision else None,
                                       "reviewer_root": str(root.path)})  # fmt: skip
    res = Applied(rec, Path(marker["project"]), resumed=True,
                  written=[escape_name(o.path) for o in ops if o.after.kind in ("file", "symlink")],
                  deleted=[escape_name(o.path) for o in ops if o.after.kind not in ("file", "symlink")],
                  merged=[escape_name(p) for p in marker.get("merged", [])])  # fmt: skip
    group = rec.task.group if rec.task else None
    if group:
        others = [r for r in db.group_records(group) if r.id != rec.id]
        res.superseded = superseded_by(others, group, rec.id)
        res.undecided = [r.id for r in others if r.status in (Status.queued, Status.running)]
    return res


def reject_queued(db: PgQueue, task_id: str, *, by: str | None, reason: str | None,
                  root: Root | None = None) -> Record:  # fmt: skip
    """`fila reject ID --queue URL`: the decision in the database, once for everyone; its
    statement signed with the key of `root` (the reviewer's) when it has one."""
    who, why = decision.decider(by), decision.check_reason(reason)
    decision.check_undecided(db.get(task_id), "reject")
    rec = decide(db, task_id, "reject", by=who, reason=why)
    if root is not None:
        attested.sign_decision(root, QueueSource(db), rec)
    return rec


def _lay_out(root: Root, db: PgQueue, rec: Record) -> None:
    """The copy apply reads (see the module doc), made afresh unless an interrupted apply of
    this task left its marker (then the copy it staged is finished as it is)."""
    tid = rec.id
    if rec.task is None:  # a record changed outside fila: nothing to lay out from
        raise Refused(f"task {tid}: its record in the queue database {db.where} has no task", task_id=tid)
    job, meta = root.job_dir(tid), root.meta(tid)
    ours = (meta / MARK).is_file()
    if ours and landing.read_marker(root, tid) is not None:
        return
    if not ours and (job.exists() or meta.exists()):
        raise InvalidInput(
            f"task id {tid} of the queue database {db.where} is also a job of this root ({job})",
            task_id=tid,
            hint="apply it from another queue root, or `fila gc` this root's decided jobs first",
        )
    for d in (job, meta):
        if d.exists():
            fsutil.remove_tree(d)
    data = queued_patch(db, rec)  # refused before anything is laid out
    sha = db.task_blobs(tid).get(INPUTS)
    if sha is None:
        raise NotFound(f"task {tid} has no {INPUTS} in the queue database {db.where}", task_id=tid)
    manifest = db.blob(sha)
    targets, entries = read_manifest(manifest)
    policy = patch.policy_for(root, rec)
    check_limits(entries, policy.max_work_files, policy.max_work_bytes)  # before anything is written
    meta.mkdir(parents=True)
    (job / "input").mkdir(parents=True)
    try:
        unpack(db, manifest, job / "input", max_files=policy.max_work_files,
               max_bytes=policy.max_work_bytes)  # fmt: skip
        (job / "DIFF.patch").write_bytes(data)
        shutil.copytree(job / "input", job / "work", symlinks=True)
        if data:
            _patch_work(meta, job, tid)
        project = jobdir.project_of(root, rec.task.model_copy(update={"project": None}), policy)
        doc = {"project": str(project), "targets": targets, "entries": entries}
        fsutil.atomic_write(meta / "manifest.json", json.dumps(doc).encode())
        fsutil.atomic_write(
            meta / MARK, json.dumps({"queue": db.where, "patch_sha256": rec.patch_sha256}).encode()
        )
    except BaseException:
        _drop(root, tid)
        raise


def _patch_work(meta: Path, job: Path, tid: str) -> None:
    home = meta / "prep"
    home.mkdir(exist_ok=True)
    res = patch_git(home).run(
        ["apply", "--whitespace=nowarn", str(job / "DIFF.patch")], work_tree=job / "work", check=False
    )
    if res.returncode != 0:
        raise landing.refuse(
            "the patch does not apply to the task's inputs as the database holds them: "
            + res.stderr.decode(errors="replace")[-400:],
            tid,
        )


def _drop(root: Root, task_id: str) -> None:
    for d in (root.job_dir(task_id), root.meta(task_id)):
        if d.exists():
            fsutil.remove_tree(d)
