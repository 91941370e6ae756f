"""The typed client (docs/api.md): fila from a program, over a queue root or a PostgreSQL queue.

One `Client` is the path every door takes: the CLI's commands (cli/tasks.py, cli/review.py) and
the MCP server (mcp/) call these methods, so a task submitted, waited for, reviewed or decided
here is checked, recorded and refused exactly as `fila submit`, `fila review` and `fila apply`
do it, with the same errors (core/errors.py: each says what failed and what to do next).

A long-lived program keeps one client: the queue database's connections (a PostgreSQL queue)
and the container engine's client (`run`) are made once and reused for every task, so a task pays
no process start-up, no imports and no connection (bench/api_long.py measures it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import FilaError, InvalidInput, TimedOut
from ..core.layout import Root
from ..core.states import Status

if TYPE_CHECKING:
    from ..core.models import Record, Task
    from ..queue.pg.store import PgQueue
    from ..review.apply import Applied
    from ..review.groups import Comparison
    from ..review.report import Review
    from ..sandbox import Backend

# A task's statuses while it waits or runs: `wait` returns at any other.
PENDING = (Status.queued, Status.running)


@dataclass
class Run:
    """What `Client.run` did: `code` is `fila run --once`'s exit code (README, "Exit codes")."""

    code: int
    records: list[Record] = field(default_factory=list)
    infra_error: FilaError | None = None  # the container engine or an image: tasks stay queued
    crash: BaseException | None = None  # a fila bug in a job (its task is recorded)
    breaker_tripped: bool = False


@dataclass
class Listing:
    """`fila ls`: records oldest first, task files dropped in fila/in without a record yet (file
    queue), and rows the queue database holds that do not read as a record (id, why)."""

    records: list[Record]
    dropped: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Patch:
    """A task's DIFF.patch, checked against the sha256 its record names, with that record."""

    record: Record
    data: bytes


def build_task(task: Task | Mapping[str, Any] | None = None, *, source: str = "arguments",
               **fields: Any) -> Task:  # fmt: skip
    """A task from a task document (a `Task`, or a mapping as a task file holds it) and fields
    that override it (None: not given), validated against the task schema as a task file is
    (InvalidTaskFile names the field; `source` names where it came from)."""
    from ..core.models import Task
    from ..queue.policy import validate_document

    data: dict[str, Any] = {}
    if isinstance(task, Task):
        data = task.model_dump(exclude_none=True)
    elif task is not None:
        data = dict(task)
    for name, value in fields.items():
        if value is None:
            continue
        dump = getattr(value, "model_dump", None)  # a Limits given as a model
        data[name] = dump(mode="json", exclude_none=True) if dump else value
    if not data:
        raise InvalidInput("nothing to submit", hint="give a task file or --engine and --target")
    validate_document("task", data, path=source)
    return Task.model_validate(data)


class Client:
    """fila's queue and review gate from Python (docs/api.md).

    `root`: the queue root (default: $FILA_ROOT, else the current directory); with `queue` (a
    PostgreSQL URL, `postgresql://user@host/db`, the password from libpq's PGPASSWORD or
    ~/.pgpass) the tasks live in that database and `root` is this host's own root: the project a
    task's targets are read from, the policies that check it, where `apply` lands a patch.
    `backend`: the container backend `run` uses (default: the root's, made on first use).

    Use it as a context manager, or call `close()`: it holds the database's connections and the
    container engine's client.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Root | None = None,
        *,
        queue: str | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.root = root if isinstance(root, Root) else Root.at(os.fspath(root) if root is not None else None)
        self.queue_url = queue
        self._db: PgQueue | None = None
        self._opening = threading.Lock()  # threads share one client (the MCP server's tools)
        self._backend = backend
        self._owns_backend = backend is None
        self._runs = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the database's connections and the container engine's client."""
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._backend is not None and self._owns_backend:
            self._backend.close()
            self._backend = None

    @property
    def db(self) -> PgQueue | None:
        """The PostgreSQL queue (opened on first use), or None on the file queue."""
        if self.queue_url is None:
            return None
        with self._opening:
            if self._db is None:
                from ..queue.pg.store import PgQueue

                self._db = PgQueue(self.queue_url, single=True)  # one call at a time: no pool to import
            return self._db

    # -- tasks in ------------------------------------------------------------------------------

    def submit(self, task: Task | Mapping[str, Any] | None = None, *, source: str = "arguments",
               **fields: Any) -> Record:  # fmt: skip
        """Queue one task and return its record (status queued): `task` is a task document (a
        `Task` or a mapping with a task file's fields), `fields` any of those fields, which
        override it (engine, prompt, targets, command, model, timeout, policy, id, fallback,
        project, image, check, limits, options, group, submitter). Checked now as `fila submit`
        checks it (engine, policy and its limits, image, targets inside the project and not
        denied, sizes): InvalidInput and its kinds, DuplicateId. On a PostgreSQL queue its
        targets travel with it (docs/scale-out.md)."""
        t = build_task(task, source=source, **fields)
        if self.db is not None:
            from ..run.remote_submit import submit_remote

            return submit_remote(self.root, self.db, t)[0]
        from ..run.intake import submit

        return submit(self.root, t)

    def submit_group(self, task: Task | Mapping[str, Any] | None, engines: Sequence[str], *,
                     models: Mapping[str, str] | None = None, source: str = "arguments",
                     **fields: Any) -> list[Record]:  # fmt: skip
        """Queue a compare group: one task per engine of `engines` on the same input (ids
        GROUP.ENGINE, GROUP the task's group or id, else generated; `models`: an engine's own
        model), every member checked and every id free before any is queued (`fila compare`)."""
        from ..review.groups import group_tasks

        # Each member's engine is its own (group_tasks); the document needs one to validate.
        fields["engine"] = fields.get("engine") or (engines[0] if engines else None)
        t = build_task(task, source=source, **fields)
        if self.db is not None:
            from ..run.remote_submit import submit_remote

            return submit_remote(self.root, self.db, t, engines=list(engines), models=dict(models or {}))
        from ..run.intake import submit_group

        return submit_group(self.root, group_tasks(t, list(engines), models=dict(models or {})))

    # -- running -------------------------------------------------------------------------------

    def run(
        self,
        only: Iterable[str] | None = None,
        *,
        once: bool = True,
        concurrency: int = 1,
        poll_s: float = 1.0,
        grace_s: float = 60.0,
        on_record: Callable[[Record], None] | None = None,
        progress: Callable[[str], None] | None = None,
        detach_teardown: bool = False,
    ) -> Run:
        """Run queued tasks in this process, as `fila run --once` does (`only`: just these ids,
        as `fila submit --run`; others are left to other workers); `once=False` is `fila worker`
        (until SIGTERM). On the main thread SIGTERM and SIGINT stop the jobs while it runs.
        `detach_teardown`: for a process that exits right after (the CLI): the job gateways
        still being removed when it returns are left to a detached reaper (docs/api.md).
        The file queue's: a PostgreSQL queue's tasks run on its runners (`fila worker --queue`),
        and `wait` returns once one has published the record."""
        if self.queue_url is not None:
            raise InvalidInput(
                "a PostgreSQL queue's tasks run on its runners, not in the submitting process",
                hint="start `fila worker --queue URL` on a runner host, and wait() for the record",
            )
        from ..run.worker import Worker

        w = Worker(
            self.root,
            once=once,
            concurrency=concurrency,
            poll_s=poll_s,
            grace_s=grace_s,
            backend=self.backend(),
            on_record=on_record or (lambda _r: None),
            progress=progress or (lambda _m: None),
            only=set(only) if only is not None else None,
            startup=self._runs == 0,  # the process's start-up is the first run's only
            detach_teardown=detach_teardown,
        )
        self._runs += 1
        code = w.run()
        crash = w.crash if isinstance(w.crash, BaseException) else None
        return Run(code, list(w.records), w.infra_error, crash, w.breaker_tripped)

    def backend(self) -> Backend:
        """The container backend `run` uses: made once (the root's, or $FILA_BACKEND) and kept."""
        with self._opening:
            if self._backend is None:
                from ..sandbox import get_backend, root_backend

                self._backend = get_backend(root_backend(self.root))
            return self._backend

    def wait(self, task_id: str, timeout: float | None = None, *, poll_s: float = 0.1) -> Record:
        """The task's record once it is neither queued nor running (run by a worker, a runner or
        `run`); TimedOut after `timeout` seconds (None: no bound), the task left as it is."""
        if self.db is not None:
            return self.db.wait_settled(task_id, poll_s=max(poll_s, 0.5), timeout_s=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rec = self.record(task_id)
            if rec.status not in PENDING:
                return rec
            if deadline is not None and time.monotonic() >= deadline:
                raise TimedOut(
                    f"task {task_id} is still {rec.status} after {timeout:g} s",
                    task_id=task_id,
                    hint="wait again, or look later: the task goes on without the wait",
                )
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    # -- reading -------------------------------------------------------------------------------

    def record(self, task_id: str) -> Record:
        """The task's review record (`fila show --json`); NotFound for an unknown id."""
        from ..review import desk

        return desk.record(self.root, self.db, task_id)

    def listing(self, status: Status | None = None) -> Listing:
        """The tasks (`fila ls`), of one status or all, oldest submitted first."""
        from ..review import desk

        recs, dropped, unreadable = desk.listing(self.root, self.db, status)
        return Listing(recs, dropped=dropped, unreadable=unreadable)

    def blobs(self, task_id: str) -> dict[str, str] | None:
        """A PostgreSQL queue's task's published files (name: sha256); None on the file queue."""
        return self.db.task_blobs(task_id) if self.db is not None else None

    def project_of(self, rec: Record) -> str:
        """The project the task's targets were read from, as `fila show` names it."""
        if self.db is not None:
            return (rec.task.project if rec.task else None) or "(the submitting host's queue root)"
        from ..review.report import project_path

        return project_path(self.root, rec)

    def patch(self, task_id: str) -> Patch:
        """The task's DIFF.patch as `fila apply` would apply it, checked against its record's
        sha256 first (Refused when it changed; NotFound when the task has none)."""
        if self.db is not None:
            from ..review.remote import queued_patch

            rec = self.db.get(task_id)
            return Patch(rec, queued_patch(self.db, rec))
        from ..queue.store import get_record
        from ..review.patch import policy_for, read_reviewed

        r = self.root.require()
        rec = get_record(r, task_id)
        return Patch(rec, read_reviewed(r, rec, policy_for(r, rec)))

    def diff(self, task_id: str) -> bytes:
        """The bytes of the task's checked DIFF.patch (`fila diff`)."""
        return self.patch(task_id).data

    def review(self, task_id: str) -> Review:
        """What a decision is about (`fila review`): the record, the checked patch parsed, the
        warnings; `review_json` is the structure `fila review --json` prints."""
        from ..review import desk

        return desk.review(self.root, self.db, task_id)

    def review_json(self, task_id: str) -> dict[str, Any]:
        """`fila review ID --json`."""
        from ..review.report import to_json

        return to_json(self.review(task_id))

    def review_html(self, task_id: str, out: Path | None = None) -> Path:
        """Write the self-contained REVIEW.html (`fila review --html`) and return its path: the
        job directory's, or for a PostgreSQL queue's task `out` (default
        <root>/fila/reviews/ID/REVIEW.html)."""
        check_review_out(out, html=True, queued=self.db is not None)
        got = self.review(task_id)
        if self.db is not None:
            from ..review.remote import review_html

            return review_html(self.root, self.db, task_id, got, out)
        from ..review.report import write_html

        return write_html(self.root, got)

    def log(self, task_id: str, *, events: bool = False) -> bytes:
        """The engine's output (`fila logs`), or with `events` the task's event log as JSON lines;
        empty while the task has none yet. The bytes are the engine's: escape before showing."""
        return b"".join(self.log_chunks(task_id, events=events))

    def log_chunks(self, task_id: str, *, events: bool = False, follow: bool = False) -> Iterator[bytes]:
        """The log as it grows; `follow` (the file queue's only): until the task is decided."""
        if self.db is not None:
            if follow:
                raise InvalidInput("--follow reads a file queue's log; with --queue the log is published "
                                   "whole when the task ends", hint="run it again once `fila ls --queue` "
                                   "shows the task decided or ready for review")  # fmt: skip
            from ..review.remote import queued_log

            return iter([queued_log(self.db, task_id, events=events)])
        from ..queue.store import log_chunks

        return log_chunks(self.root.require(), task_id, events=events, follow=follow)

    def compare(self, group: str) -> Comparison:
        """A compare group's members side by side (`fila compare`); `compare_json` is its
        `--json`."""
        from ..review import desk

        return desk.compare(self.root, self.db, group)

    def compare_json(self, group: str) -> dict[str, Any]:
        from ..review.groups import to_json

        return to_json(self.compare(group))

    # -- the decision --------------------------------------------------------------------------

    def apply(
        self,
        task_id: str,
        *,
        by: str | None = None,
        reason: str | None = None,
        three_way: bool = False,
        allow_git_metadata: bool = False,
        allow_credential: bool = False,
        attestations: Path | None = None,
    ) -> Applied:
        """Land the task's reviewed patch in the project, or nothing, and record the decision by
        `by` (default $FILA_USER, else the login name), as `fila apply --yes` does: ApplyRefused
        and its reasons, InvalidTransition for a task decided already (naming who decided). A
        compare group's other members are superseded. On a PostgreSQL queue the project is this
        client's root. `attestations`: a directory the task's signed statements are written to
        once it is applied (`fila apply --attestations`, docs/provenance.md)."""
        options: dict[str, Any] = {"by": by, "reason": reason, "three_way": three_way,
                                   "allow_git_metadata": allow_git_metadata,
                                   "allow_credential": allow_credential,
                                   "attestations": attestations}  # fmt: skip
        from ..review import desk

        return desk.apply_task(self.root, self.db, task_id, **options)

    def apply_on_branch(self, task_id: str, branch: str, **options: Any) -> tuple[Applied, Any]:
        """`apply` onto a new branch of the project's git checkout (`fila apply --branch`): the
        same checks and decision, the patch committed in a temporary worktree at HEAD with
        trailers naming the task, its sha256, its signed run statement and the reviewer; returns
        what landed and where (review/branch.py). `options` are `apply`'s, `attestations` too."""
        from ..review.branch import apply_on_branch

        return apply_on_branch(self.root, self.db, task_id, branch, **options)

    def reject(self, task_id: str, *, by: str | None = None, reason: str | None = None) -> Record:
        """Record the refusal (`fila reject`); the project is not touched."""
        from ..review import desk

        return desk.reject_task(self.root, self.db, task_id, by=by, reason=reason)

    def retry(self, task_id: str, *, by: str | None = None, reason: str | None = None) -> Record:
        """Queue a failed or needs_human task again (`fila retry`), the person's decision recorded."""
        from ..review import desk

        return desk.retry_task(self.root, self.db, task_id, by=by, reason=reason)


def check_review_out(out: Path | None, *, html: bool, queued: bool) -> None:
    """A REVIEW.html path of one's choosing is for a PostgreSQL queue's task only (a file queue's
    goes in its job directory)."""
    if out is not None and not (html and queued):
        raise InvalidInput("--out is for --html with --queue", hint="on the file queue REVIEW.html "
                           "goes in the job directory")  # fmt: skip


def record_json(rec: Record) -> dict[str, Any]:
    """A record as `fila show --json` prints it."""
    return rec.model_dump(mode="json")


def decision_json(task_id: str, rec: Record) -> dict[str, Any]:
    """`fila reject --json`: the status and the decision."""
    d = rec.decision
    return {"id": task_id, "status": rec.status, "decision": d.model_dump(mode="json") if d else None}


def applied_json(task_id: str, res: Applied) -> dict[str, Any]:
    """`fila apply --json`: the decision and what landed."""
    d = res.record.decision
    return {
        "id": task_id,
        "status": res.record.status,
        "project": str(res.project),
        "decision": d.model_dump(mode="json") if d else None,
        "written": res.written,
        "deleted": res.deleted,
        "merged": res.merged,
        "resumed": res.resumed,
        "changed_not_touched": res.moved_untouched,
        "superseded": res.superseded,
        "not_superseded": res.undecided,
        "credential_markers": res.credential_markers,
        "provenance": res.provenance,
        "attestations": res.attestations,
    }
