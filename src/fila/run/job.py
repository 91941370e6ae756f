"""The cycle (docs/architecture.md, "The cycle", steps 1-7): submit, claim, prepare, run, diff, record, stop.

`next_claim` picks the task; `run_one` takes one claimed task to a final record: the task
checked (`intake`), its state while it runs (`claimed`), its engines run with their fallbacks and
the last one's diff and record (`attempts`), and every way it can fail settled here. It never
touches the project: after the record is written, nothing happens until a person decides
(`fila apply` / `fila reject`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core import fsutil
from ..core.errors import (
    FilaError,
    ImageMissing,
    InfraError,
    InvalidInput,
    InvalidTaskFile,
    InvalidTransition,
    LimitExceeded,
)
from ..core.faults import crash_point
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, ImageRef, Record, Status
from ..engines import get_engine
from ..env.build import EnvironmentFailed
from ..queue import lease, retry
from ..queue import store as queue
from . import environment
from .attempts import run_engines
from .claimed import Hooks, Interrupted, JobRun
from .intake import check_task, parse_task_file

if TYPE_CHECKING:
    from ..sandbox import Backend

LeaseLost = queue.LeaseLost

RETRY_HINT = "`fila retry ID` runs it again from a clean copy, `fila reject ID` drops it."


def _lost(root: Root, claim: queue.Claim, why: str = "lease lost") -> None:
    queue.log_event(root, claim.task_id, "result discarded", reason=why, claim=claim.name)


def _reject_invalid(root: Root, claim: queue.Claim, err: InvalidInput) -> Record | None:
    """A task file that does not validate: record `failed`/`invalid` (under the fence), then
    keep the file in fila/rejected/. A crash between leaves a claim that recovery rejects."""
    tid = claim.task_id
    kept = root.rejected_dir / f"{tid}.json"
    where = f"file kept in {kept}" if queue.keepable(claim.path) else f"entry removed; see {kept}.reason"

    def guard(_cur: Record | None) -> None:
        if not queue.holds(claim):
            raise queue.LeaseLost(claim.name)

    try:
        rec = queue.set_status(
            root,
            tid,
            Status.failed,
            expect={None, Status.queued},
            guard=guard,
            event="rejected",
            error=ErrorInfo(kind=ErrorKind.invalid, message=f"{err} ({where})"),
        )
    except queue.LeaseLost:
        return _lost(root, claim)
    except InvalidTransition:
        queue.unclaim(root, claim)  # the id is in use: recovery deals with the duplicate
        return None
    with contextlib.suppress(FileNotFoundError):
        queue.reject_file(root, claim.path, str(err), name=f"{tid}.json")
    return rec


def run_one(
    root: Root,
    claim: queue.Claim,
    *,
    backend: Backend,
    progress: Callable[[str], None] = lambda _m: None,
    hooks: Hooks | None = None,
) -> Record | None:
    """Take one claimed task to its record. Returns None when the claim was lost (reaped, or a
    duplicate file put back for recovery). Raises InfraError after handing the task back when
    the infrastructure failed before its container started."""
    hooks = hooks or Hooks()
    tid = claim.task_id
    crash_point("after_claim")
    t0 = time.monotonic()
    try:
        task = parse_task_file(claim.path, expected_id=tid)
    except InvalidInput as e:
        if not queue.holds(claim):
            return _lost(root, claim)
        return _reject_invalid(root, claim, e)
    try:
        rec = queue.begin(root, claim, task)
    except queue.LeaseLost:
        return _lost(root, claim)
    except InvalidTransition as e:
        queue.unclaim(root, claim)
        queue.log_event(root, tid, "not started", reason=str(e), claim=claim.name)
        return None
    crash_point("after_begin")
    run = JobRun(root, claim, backend, progress, hooks, rec.attempt)
    run.mark = t0
    run.lap("begin")  # the task file read and checked, the running record written
    if not hooks.claim_said:
        progress(f"{tid}: claimed (attempt {rec.attempt})")
    try:
        hooks.check()
        checked = check_task(root, task, tags_of=backend.tags)
        try:
            checked = environment.apply(run, checked)  # the project's toolchain, built or found
        except EnvironmentFailed as e:
            return run.finish(
                Status.failed,
                error=ErrorInfo(kind=ErrorKind.environment, message=str(e)),
                environment=e.record,
            )
        if checked.environment is not None:
            run.lap("environment")  # built (the setup) or found by its key
        # Every image the job may need, before any container: a missing fallback image is found
        # now, not after the first engine ran out of quota.
        check_image = checked.check_image or get_engine("shell").image_tag()
        need = [*checked.chain, *([("shell", check_image)] if task.check else [])]
        refs: dict[str, ImageRef] = {}
        for name, image in need:
            ref = backend.image(image)
            if ref is None and task.image is not None and image == checked.image:
                # An image the task pinned is not on this host (a digest never built here, a tag
                # nobody builds): no retry makes it appear, so it is the task's own failure, and
                # the queue goes on. The engines' own images stay a wait-and-retry (ImageMissing):
                # `fila images build` may be making one right now.
                hint = f"build it, or leave `image` out to run {name}'s own (`fila images build {name}`)"
                # The hint is in the message too: the record keeps only the message.
                raise InvalidTaskFile(
                    f"image {image!r} is not present in {backend.name}; {hint}", field="image", hint=hint
                )
            if ref is None:
                raise ImageMissing(
                    f"image {image} is not built", task_id=tid, hint=f"run `fila images build {name}`"
                )
            refs[image] = ref
        want = backend.runtime_for(checked.policy)
        if want is not None and want not in backend.runtimes():
            # The policy's runtime is not registered: every task of that policy would fail the
            # same way, but tasks of other policies must still run. Counted by the breaker
            # (infra): the host is not set up as its policy says.
            return run.finish(
                Status.failed,
                error=ErrorInfo(
                    kind=ErrorKind.infra,
                    message=f"policy {task.policy!r} runs containers with the runtime {want!r}, which "
                    f"{backend.name} does not have (it has: {', '.join(sorted(backend.runtimes()))}); "
                    f"register {want!r} (for runsc: scripts/docker-up as root) or change the "
                    f"policy's runtime",
                ),
            )
        run.lap("validate")  # policy, targets, images, runtime: what can be known before a container
        with lease.job_lock(root, tid, wait_s=lease.JOB_LOCK_WAIT_S):
            try:
                return run_engines(run, checked, refs, rec.attempt, t0)
            finally:
                run.settle_removals()  # an error after the run: the container goes before the lock
    except (InvalidInput, LimitExceeded) as e:
        return run.finish(Status.failed, error=ErrorInfo(kind=ErrorKind.invalid, message=str(e)))
    except queue.LeaseLost:
        return _lost(root, claim)
    except Interrupted as e:
        if not run.container_started:
            return run.requeue(e, outcome="handed back")
        left = run.left_running(e)
        if left:
            progress(f"{tid}: {run.fence_off(f'interrupted: {e}', left)}")
            return None
        return run.finish(
            Status.needs_human,
            error=ErrorInfo(kind=ErrorKind.interrupted, message=f"interrupted: {e}"),
            diagnosis="the worker was stopped while the container ran; the container was "
            f"removed and work/ may hold a partial change. {RETRY_HINT}",
        )
    except InfraError as e:
        refusal = backend.refusal(e)
        if not run.container_started and not retry.INFRA.transient(e, refused=refusal is not None):
            # Docker refused this task's request itself: retrying cannot help, and the next
            # task must still run. The task's record says why; the run goes on.
            return run.finish(
                Status.failed,
                error=ErrorInfo(
                    kind=ErrorKind.invalid, message=f"{backend.name} refused this task: {refusal}"
                ),
            )
        if not run.container_started:
            run.requeue(e, outcome="requeued")
            raise
        left = run.left_running(e)
        if left:
            raise run.fence_off(str(e), left) from e
        return run.finish(
            Status.needs_human,
            error=ErrorInfo(kind=ErrorKind.infra, message=str(e)),
            diagnosis=f"{backend.name} failed while the container ran: {e}. work/ may hold "
            f"a partial change. {RETRY_HINT}",
        )
    except (FilaError, OSError) as e:
        if isinstance(e, OSError) and fsutil.host_fault(e) and not run.container_started:
            # The host's disk or descriptors, before any container: an infra error, requeued (a
            # runner of the PostgreSQL queue hands it back uncounted), not this task's failure.
            err = InfraError(f"task {tid}: this host failed before the container: {e}")
            run.requeue(err, outcome="requeued")
            raise err from e
        # Neither the infrastructure (InfraError is above) nor the worker stopping: this task's
        # project or job directory (an unreadable directory, a file swapped during the copy, a
        # cleanup the engine blocked). Its record says so and the run goes on; handing it back
        # would claim it again at once, forever. OSError counts as infra (the disk may be full).
        kind = ErrorKind.infra if isinstance(e, OSError) else ErrorKind.invalid
        msg = str(e) if isinstance(e, FilaError) else f"{type(e).__name__}: {e}"
        if isinstance(e, FilaError) and e.hint:  # the record keeps only the message
            msg += f"; {e.hint}"
        if run.container_started:
            left = run.left_running(e)
            if left:
                raise run.fence_off(f"after the run: {msg}", left) from e
            return run.finish(
                Status.failed,
                error=ErrorInfo(kind=ErrorKind.engine_error, message=f"after the run: {msg}"),
                diagnosis=f"fila could not finish the job after the run (work/ not made safe, or "
                f"unreadable); no diff was taken from it. {RETRY_HINT}",
            )
        return run.finish(Status.failed, error=ErrorInfo(kind=kind, message=msg))
    except BaseException as e:  # bugs, KeyboardInterrupt: never leave a running record behind
        msg = f"interrupted: {type(e).__name__}: {e}".rstrip(": ")
        left = run.left_running(e) if run.container_started else []
        if left:
            progress(f"{tid}: {run.fence_off(msg, left)}")
        elif run.container_started:
            run.finish(
                Status.needs_human,
                error=ErrorInfo(kind=ErrorKind.interrupted, message=msg),
                diagnosis=f"the worker stopped while the container ran. {RETRY_HINT}",
            )
        elif isinstance(e, Exception):
            # A bug in fila, not the worker stopping: handed back, the task would be claimed
            # again at once and fail the same way, forever. Its record says so; the worker
            # still reports the bug loudly.
            bug = f"fila bug: {type(e).__name__}: {e}".rstrip(": ")
            run.finish(Status.failed, error=ErrorInfo(kind=ErrorKind.infra, message=bug))
        else:  # KeyboardInterrupt, SystemExit: the worker is really stopping
            run.requeue(InfraError(msg), outcome="handed back")
        raise


# -- processing the queue --------------------------------------------------------------------


def claimable(root: Root, path: Path, now: float) -> bool:
    """A file in in/ a worker may claim now: no record yet (dropped), or a queued record whose
    backoff is over. Any other record means a duplicate or an interrupted hand back, which
    recovery settles; claiming it would only bounce."""
    if not queue.valid_id(path.stem):
        return True  # claimed to be rejected with a reason
    try:
        rec = queue.read_record(root, path.stem)
    except ValueError:
        return False
    if rec is None:
        return True
    return rec.status == Status.queued and not (rec.not_before and rec.not_before > now)


def reject_strays(root: Root, progress: Callable[[str], None] = lambda _m: None) -> None:
    """Move every entry of in/ that can never be a task to fila/rejected/ with its reason."""
    for path in queue.stray_entries(root):
        kept = queue.reject_stray(root, path)
        if kept is not None:
            progress(f"{path.name!r} in fila/in is not a task file name: rejected ({kept}.reason)")


def next_claim(
    root: Root,
    worker: str,
    progress: Callable[[str], None] = lambda _m: None,
    *,
    only: set[str] | None = None,
) -> queue.Claim | None:
    """Claim the next task by rename (`only`: among these ids; the others stay queued)."""
    reject_strays(root, progress)
    now = time.time()
    for path in queue.queued_files(root):
        if only is not None and path.stem not in only:
            continue
        if claimable(root, path, now):
            c = queue.try_claim(root, path, worker)
            if c:
                return c
    return None


def earliest_backoff(root: Root) -> float | None:
    waits = []
    for path in queue.queued_files(root):
        rec = queue.read_record(root, path.stem) if queue.valid_id(path.stem) else None
        if rec and rec.status == Status.queued and rec.not_before:
            waits.append(rec.not_before)
    return min(waits) if waits else None
