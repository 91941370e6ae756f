"""One claimed task's state while it runs (docs/architecture.md, "The queue's contract"): the
phases' timings, the container's removals, the fence and the checkpoints, and `finish`, which
publishes its record at most once; `Hooks` and `Interrupted`, how a worker steers and stops it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.errors import FilaError, InfraError
from ..core.faults import crash_point
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Policy, Record, Status
from ..queue import retry
from ..queue import store as queue

if TYPE_CHECKING:
    from ..sandbox import Backend
    from ..sandbox.base import Removal
    from .quota_watch import QuotaWatch


class Interrupted(Exception):
    """The worker is stopping (SIGTERM, Ctrl-C): the job stops at its next safe point.

    Not an OSError or a Docker error on purpose: the sandbox must let it through, remove the
    container, and re-raise it.
    """


class Hooks:
    """How a worker steers one job. This default never interrupts (a plain `run_one` call)."""

    # Whether the worker has said "claimed" itself (a runner of the PostgreSQL queue says it as it
    # takes the lease, with the lease's token): `run_one` then does not say it again.
    claim_said = False

    def check(self) -> None:
        """Raise Interrupted (worker stopping) or LeaseLost (claim reaped) to stop the job."""

    def before_start(self, container: str) -> None:
        """The container `container` starts as soon as this returns: the side-effect boundary, and
        the last chance to stop before it. A draining worker stops here (run/worker.py); a runner
        of the PostgreSQL queue marks the task started in the database here (run/lease_hooks.py)."""
        self.check()

    def timings(self) -> dict[str, float]:
        """Seconds this task cost before `run_one` (the process's start-up, the claim), first in
        the record's `timings`."""
        return {}


class JobRun:
    """State of one claimed task while it runs; `finish` publishes at most once."""

    def __init__(
        self,
        root: Root,
        claim: queue.Claim,
        backend: Backend,
        progress: Callable[[str], None],
        hooks: Hooks,
        attempt: int,
    ):
        self.root, self.claim, self.backend, self.progress = root, claim, backend, progress
        self.attempt = attempt
        self.hooks = hooks
        self.tid = claim.task_id
        self.timings: dict[str, float] = dict(hooks.timings())
        self.mark = time.monotonic()
        self.container_started = False
        self.beats = 0
        self.removals: list[Removal] = []  # containers exited and still being removed
        self.removal_warnings: list[str] = []
        self.removal_failed = False  # a container this job started may not be gone
        self.watch: QuotaWatch | None = None  # set while an engine runs with a fallback waiting

    def lap(self, phase: str) -> None:
        """The seconds since the previous lap, added to `phase` (a fallback engine adds to its
        phases): the phases are contiguous, so they add up to `total`."""
        now = time.monotonic()
        self.timings[phase] = round(self.timings.get(phase, 0.0) + now - self.mark, 3)
        self.mark = now

    def split_run(self, since: float, started: float | None, waited: float) -> None:
        """The backend's run as create (and the durable container-started checkpoint), start and
        wait (the container's own lifetime, as the backend measured it), and remove (the exit's
        inspection, the removal, handing work/ back): they add up to `run`."""
        whole = self.mark - since
        create = (started - since) if started is not None else whole
        wait = max(0.0, min(waited, whole - create)) if started is not None else 0.0
        for phase, s in (("create", create), ("start_wait", wait), ("remove", whole - create - wait)):
            self.timings[phase] = round(self.timings.get(phase, 0.0) + s, 3)

    def await_removal(self) -> None:
        """Wait for the removals of the containers that exited (the backend returns before its
        container is gone, so the diff runs meanwhile). Before anything about the job is
        published: a claim outlives its container, which recovery's sweep relies on. The wait
        left after the diff counts as the container's `remove` (and `run`); a failed removal
        raises what the backend's run raises for it (InfraError)."""
        while self.removals:
            removal = self.removals.pop(0)
            removal.wait()
            now = time.monotonic()
            for phase in ("run", "remove"):
                self.timings[phase] = round(self.timings.get(phase, 0.0) + now - self.mark, 3)
            self.mark = now
            self.add_parts(removal.timings)
            self.removal_warnings += removal.warnings

    def add_parts(self, parts: dict[str, float]) -> None:
        """Seconds inside a phase the record also shows on their own (the gateway's start or take,
        ready and removal, inside `create` and `remove`): not added to `total` again."""
        for k, v in parts.items():
            self.timings[k] = round(self.timings.get(k, 0.0) + v, 3)

    def settle_removals(self) -> None:
        """await_removal on a path that failed already (a bug, a lost lease), whatever way the
        job ended and before its directory is free again: a removal that failed too becomes a
        warning of the record it publishes (recovery removes what is left by its labels)."""
        while self.removals:
            removal = self.removals.pop(0)
            try:
                removal.wait()
                self.removal_warnings += removal.warnings
            except Exception as e:
                self.removal_failed = True
                self.removal_warnings.append(f"{e}; `fila recover` removes what is left")

    def left_running(self, err: BaseException) -> list[str]:
        """After a failure once the container started: what of the job may still be there (its
        container, gateway or volume), from what the backend could not remove and from asking it
        (a container listed, or no answer). Empty only when the backend confirmed all gone."""
        from ..sandbox.base import left_behind

        left = [what for what, running in left_behind(err) if running]
        if self.removal_failed:
            left += self.removal_warnings
        try:
            boxes = self.backend.find(job_id=self.tid, root=str(self.root.path))
        except Exception as e:  # no answer: nothing is confirmed gone
            left.append(f"{self.backend.name} could not list the job's containers: {e}")
        else:
            left += [f"container {b.describe()} is still there" for b in boxes]
        return left

    def fence_off(self, msg: str, left: list[str]) -> InfraError:
        """A failed run whose container (or gateway, volume) may still be there is not published
        as over: the record stays running, says so (warnings, error, an event), and the claim
        becomes the `.reaped` tombstone recovery keeps while it is undecided, so no `fila retry`
        and no second engine can start until recovery confirms the container is gone and
        decides (needs_human). Returns the error for the caller to raise (stderr, exit 3)."""
        what = "; ".join(left)
        fields: dict[str, Any] = {
            "warnings": [f"the job may still be running: {what}"],
            "error": ErrorInfo(kind=ErrorKind.infra, message=f"{msg}; and then: {what}"),
        }
        with contextlib.suppress(FilaError, OSError):  # lost meanwhile: recovery has it already
            self.checkpoint(event="cleanup failed", **fields)
        fenced = queue.win(self.claim, "reaped")
        queue.log_event(self.root, self.tid, "fenced", reason=what, claim=self.claim.name, kept=fenced)
        how = (
            f"the task stays running ({self.claim.tombstone('reaped').name} kept) until `fila recover` "
            "confirms its container is gone and decides it (needs_human)"
            if fenced
            else "its claim was taken meanwhile: recovery decides it"
        )
        return InfraError(
            f"{msg}; and the job's container may still be there: {what}; {how}",
            task_id=self.tid,
            hint="run `fila recover` once the container engine answers: it removes the container "
            "and then decides the task",
        )

    def checkpoint(self, **fields: Any) -> None:
        queue.checkpoint(self.root, self.claim, **fields)

    def fence(self) -> None:
        """Raise LeaseLost unless the claim is still this worker's and the record is running for
        this attempt. Checked before each step with a side effect outside the record (rebuilding
        the job directory, starting the container): a zombie whose claim was reaped must not
        touch a later attempt's job directory or start an engine after recovery decided."""
        if not queue.holds(self.claim):
            raise queue.LeaseLost(f"{self.claim.name}: the claim is gone")
        cur = queue.read_record(self.root, self.tid)
        if (
            cur is None
            or cur.status != Status.running
            or cur.worker != self.claim.worker
            or cur.attempt != self.attempt
        ):
            raise queue.LeaseLost(f"{self.claim.name}: the record is no longer this claim's")

    def heartbeat(self) -> None:
        """Called by the backend every second while the container runs: is the claim still ours,
        and was a stop asked for. It writes nothing: the worker's heartbeat thread is the one
        writer of the lease (Worker._heartbeats)."""
        self.beats += 1
        crash_point("after_container_start")
        if self.beats >= 2:
            crash_point("during_run")
        if not queue.holds(self.claim):
            raise queue.LeaseLost(self.claim.name)
        self.hooks.check()
        if self.watch is not None:
            self.watch.check()  # StopRun: the backend stops the container and returns its result

    def finish(self, status: Status, **fields: Any) -> Record | None:
        self.settle_removals()  # none left on the usual path: awaited after the diff
        if self.removal_warnings:
            fields["warnings"] = [*fields.get("warnings", []), *self.removal_warnings]
        t = time.monotonic()
        # Every outcome names the backend, also a task refused before any container.
        fields.setdefault("backend", self.backend.name)
        rec = queue.publish(
            self.root, self.claim, status, {**fields, "timings": self.timings}, attempt=self.attempt
        )
        if rec is not None:
            # A record cannot hold the time of its own durable write: the copy handed back
            # (printed by `run --once --json`) does.
            rec.timings["record"] = round(time.monotonic() - t, 3)
        return rec

    def attest(self, rec: Record, policy: Policy) -> None:
        """The run statement of a task that reached review, signed with the root's key when it
        has one (docs/provenance.md). A statement that cannot be made leaves the task in review,
        with the reason in its events: `fila verify` and `fila apply` then name it missing."""
        from ..provenance import keys

        if not keys.has_signer(self.root):  # provenance is off: signing's imports are not paid
            return
        from ..provenance import attest

        try:
            attest.on_review(self.root, rec, policy)
        except (FilaError, OSError, ValueError) as e:
            queue.log_event(self.root, self.tid, "provenance not signed", reason=str(e))
            self.progress(f"{self.tid}: provenance not signed: {e}")

    def requeue(self, err: BaseException, *, outcome: str) -> Record | None:
        """Before the container started: back to the queue. `requeued` (an infrastructure error)
        backs off and counts toward the cap; `handed back` (the worker is stopping) does not."""
        kind = ErrorKind.interrupted if outcome == "handed back" else ErrorKind.infra
        nb = None
        if outcome == "requeued":
            tries = retry.INFRA.tries(queue.read_record(self.root, self.tid)) + 1
            if retry.INFRA.gives_up(tries):
                return self.finish(
                    Status.failed,
                    error=ErrorInfo(kind=ErrorKind.infra, message=f"{err} (gave up after {tries} attempts)"),
                )
            nb = time.time() + retry.INFRA.backoff(tries)
        ok = queue.hand_back(
            self.root,
            self.claim,
            error=ErrorInfo(kind=kind, message=str(err)),
            outcome=outcome,
            not_before=nb,
        )
        return queue.read_record(self.root, self.tid) if ok else None
