"""The cycle (docs/architecture.md, "The cycle", steps 1-7): submit, claim, prepare, run, diff, record, stop.

`run_one` takes one claimed task to a final record. It never touches the project: after the
record is written, nothing happens until a person decides (`fila apply` / `fila reject`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import untrusted
from ..core.errors import (
    DuplicateId,
    FilaError,
    ImageMissing,
    InfraError,
    InvalidInput,
    InvalidTaskFile,
    InvalidTransition,
    LimitExceeded,
    TargetError,
    UnknownEngine,
)
from ..core.faults import crash_point
from ..core.layout import Root
from ..core.models import (
    Attempt,
    EngineReport,
    ErrorInfo,
    ErrorKind,
    ImageRef,
    Policy,
    PolicyRef,
    Record,
    Status,
    Task,
    Workspace,
    now_iso,
)
from ..egress import config as egress
from ..engines import Engine, get_engine, scanner_for
from ..queue import lease, retry
from ..queue import store as queue
from ..queue.policy import (
    Effective,
    image_allowed,
    load_json,
    load_policy,
    narrow,
    policy_path,
    validate_document,
)
from ..workspace import jobdir, secretscan

if TYPE_CHECKING:
    from ..sandbox import Backend
    from ..sandbox.base import Removal, RunResult, RunSpec
    from ..workspace.strategy import JobWorkspace
    from .quota_watch import QuotaWatch

HEARTBEAT_IN_RUN_S = 1.0  # how often the sandbox calls back: the lease, and a stop request
LeaseLost = queue.LeaseLost


@dataclass(frozen=True)
class Checked:
    task: Task
    engine: Engine
    policy: Policy
    policy_ref: PolicyRef
    effective: Effective
    project: Path
    targets: list[str]
    image: str
    # The engines run in turn on quota (the task's own first) and the image of each.
    chain: tuple[tuple[str, str], ...] = ()


def parse_task_file(path: Path, *, expected_id: str | None = None) -> Task:
    """An untrusted task file (fila/in/, `fila submit FILE`): never blocks, never follows a link."""
    return parse_task_data(load_json(path, "task"), path=path, expected_id=expected_id)


def parse_task_bytes(raw: bytes, *, source: str) -> Task:
    """An untrusted task read from a stream (`fila submit -`), capped by the caller."""
    if len(raw) > untrusted.MAX_TASK_BYTES:
        raise InvalidTaskFile(f"the task is above the {untrusted.MAX_TASK_BYTES}-byte limit", path=source)
    return parse_task_data(
        untrusted.parse_json(raw, kind="task", error=InvalidTaskFile, path=source), path=source
    )


def parse_task_data(data: Any, *, path: Path | str, expected_id: str | None = None) -> Task:
    validate_document("task", data, path=path)  # the schema, then the model: names the field
    task = Task.model_validate(data)
    check_names(task, path=path)
    if expected_id and task.id and task.id != expected_id:
        raise InvalidTaskFile(
            f"id {task.id!r} differs from the file name's {expected_id!r}", field="id", path=path
        )
    return task


def check_names(task: Task, *, path: Path | str | None = None) -> None:
    """Names and paths a task hands to file names, argv and terminals hold no control or bidi
    characters (prompt and command may: they are text, quoted where shown)."""
    untrusted.check_names(
        [
            ("id", task.id),
            ("engine", task.engine),
            ("model", task.model),
            ("policy", task.policy),
            ("project", task.project),
            ("image", task.image),
            *((f"targets.{i}", t) for i, t in enumerate(task.targets)),
            *((f"fallback.{i}", f) for i, f in enumerate(task.fallback or [])),
            ("group", task.group),
        ],
        error=InvalidTaskFile,
        path=path,
    )


IMAGE_ID_RE = re.compile(r"(sha256:)?[0-9a-f]{12,64}")


def fallback_chain(task: Task, policy: Policy) -> list[tuple[str, str]]:
    """(field, engine) in the order they run on quota: the task's engine, then its `fallback`, or
    the policy's when the task names none (an explicit [] means none). An engine named twice runs
    once: it would only report quota again."""
    own = task.fallback is not None
    rest = task.fallback if own else policy.fallback
    chain = [("engine", task.engine)]
    for i, name in enumerate(rest or []):
        if name not in (n for _f, n in chain):
            chain.append((f"fallback.{i}" if own else f"policy {task.policy!r} fallback.{i}", name))
    return chain


def _engine_for(field: str, name: str) -> Engine:
    try:
        return get_engine(name)
    except UnknownEngine as e:  # the field, so a fallback's typo is not blamed on `engine`
        raise InvalidTaskFile(e.message, field=field, hint=e.hint) from None


def check_task(root: Root, task: Task, *, tags_of: Callable[[str], list[str]] | None = None) -> Checked:
    """Everything that can be known to be wrong before a container exists. `tags_of` (Docker)
    resolves a pinned image the policy's patterns do not name literally (an image id) to its tags."""
    check_names(task)
    if task.image is not None and not untrusted.image_reference(task.image):
        raise InvalidTaskFile(
            f"{task.image!r} is not a Docker image reference",
            field="image",
            hint="name[:tag][@sha256:digest], names in lowercase letters, digits and . _ -",
        )
    engine = _engine_for("engine", task.engine)
    engine.config(task)
    policy, ref = load_policy(root, task.policy)
    size = len(task.prompt.encode())
    if size > policy.max_prompt_bytes:
        raise InvalidTaskFile(
            f"the prompt is {size} bytes, above policy {task.policy!r}'s max_prompt_bytes "
            f"{policy.max_prompt_bytes}",
            field="prompt",
            hint="shorten the prompt (put long context in a target file), or use a policy with a larger cap",
        )
    eff = narrow(policy, task, name=task.policy)
    project = jobdir.project_of(root, task, policy)
    if not project.is_dir():
        raise TargetError("project directory does not exist", path=project)
    targets = jobdir.resolve_targets(root, project, task.targets, policy)
    image = task.image or engine.image_tag()
    allowed = f"allowed: {', '.join(policy.images) or 'none'}"
    # Only an image id is judged by its tags: a name is judged as written, never by what it points to.
    by_id = bool(task.image and IMAGE_ID_RE.fullmatch(task.image))
    if not image_allowed(policy, image) and not (
        by_id and tags_of and image_allowed(policy, image, tags_of(image))
    ):
        raise InvalidTaskFile(
            f"image {image!r} is not allowed by policy {task.policy!r} ({allowed})",
            field="image" if task.image else "engine",
            hint="pin an image the policy's `images` patterns match (an image id counts by its tags)",
        )
    chain = [(task.engine, image)]
    for field, name in fallback_chain(task, policy)[1:]:
        fb = _engine_for(field, name)
        fb.config(task)
        # A pinned image is the task engine's: each fallback engine runs its own image.
        if not image_allowed(policy, fb.image_tag()):
            raise InvalidTaskFile(
                f"fallback engine {name!r} runs image {fb.image_tag()!r}, which policy {task.policy!r} "
                f"does not allow ({allowed})",
                field=field,
            )
        chain.append((name, fb.image_tag()))
    stray = sorted(set(task.options or {}) - {n for n, _i in chain})
    if stray:  # an option for an engine that never runs would be ignored in silence
        raise InvalidTaskFile(
            f"options.{stray[0]}: {stray[0]!r} is not an engine this task runs "
            f"({', '.join(n for n, _i in chain)})",
            field=f"options.{stray[0]}",
        )
    policy = _routes_checked(root, task, policy)
    if task.check and not image_allowed(policy, get_engine("shell").image_tag()):
        raise InvalidTaskFile(
            f"the check runs in {get_engine('shell').image_tag()!r}, which policy {task.policy!r} "
            f"does not allow ({allowed})",
            field="check",
        )
    return Checked(task, engine, policy, ref, eff, project, targets, image, tuple(chain))


def chain_routes(task: Task, policy: Policy) -> list[str]:
    """The model routes the task's engines (its fallbacks too) use: each engine's own, and every
    route of the policy for an engine whose command may call any (shell)."""
    given = list(policy.egress.routes) if policy.egress else []
    out: dict[str, None] = {}
    for _field, name in fallback_chain(task, policy):
        eng = get_engine(name)
        out.update(dict.fromkeys(given if eng.any_route else eng.routes))
    return list(out)


def _routes_checked(root: Root, task: Task, policy: Policy) -> Policy:
    """Every engine of the chain has its model routes in the policy, and each route a task's
    engine uses has a readable credential (README, "Network allowlist"); the policy the job runs
    under keeps only those routes, so its gateway holds no other key."""
    given = policy.egress.routes if policy.network == "allowlist" and policy.egress else {}
    for field, name in fallback_chain(task, policy):
        missing = [r for r in get_engine(name).routes if r not in given]
        if not missing:
            continue
        route = missing[0]
        var = egress.KNOWN_ROUTES[route].key_env
        shipped = (
            f"use the shipped policy {route!r} (--policy {route}: network allowlist, the {route} route, "
            f"the key from {var}; `fila init` writes it to policies/{route}.json)"
        )
        if policy.network != "allowlist":
            raise InvalidTaskFile(
                f"engine {name!r} reaches its model through the gateway's {route!r} route, and policy "
                f"{task.policy!r} has network {policy.network!r}: no gateway, no route",
                field=field,
                hint=shipped,
            )
        raise InvalidTaskFile(
            f"engine {name!r} talks to model route {route!r}, and policy {task.policy!r} "
            f"has no egress.routes.{route} (no credential for it)",
            field=field,
            hint=f"{shipped}, or add egress.routes.{route} with its credential to policy {task.policy!r}",
        )
    if policy.network != "allowlist":
        return policy
    used = chain_routes(task, policy)
    egress.check_credentials(policy, used, path=policy_path(root, task.policy))
    return egress.only_routes(policy, used)


def root_tags(root: Root) -> Callable[[str], list[str]]:
    """The local tags of an image (by id or name), for the policy's image patterns, as the queue
    root's own backend (its fila/config.json, or FILA_BACKEND) has them; none when not built."""

    def tags_of(image: str) -> list[str]:
        from ..sandbox import get_backend, root_backend

        backend = get_backend(root_backend(root))
        try:
            return backend.tags(image)
        finally:
            backend.close()

    return tags_of


def submit(root: Root, task: Task) -> Record:
    root.require()
    # Through the reader a claim uses: a task built from options (a NUL in --prompt) is refused
    # here, not queued and then refused at claim.
    task = parse_task_bytes(queue.task_json(task).encode(), source="the submitted task")
    check_task(root, task, tags_of=root_tags(root))
    return queue.enqueue(root, task.id or queue.new_task_id(), task)


def submit_group(root: Root, tasks: list[Task]) -> list[Record]:
    """Queue a compare group's members (compare.group_tasks): every member is checked (engine
    options, image, policy) and every id is free before any is queued."""
    root.require()
    for t in tasks:
        assert t.id is not None
        where = queue.id_in_use(root, t.id)
        if where:
            raise DuplicateId(f"task id {t.id!r} exists already ({where})", task_id=t.id,
                              hint="choose another group id (--id)")  # fmt: skip
        check_task(root, Task.model_validate(t.model_dump()))
    return [submit(root, t) for t in tasks]


# -- running one task ------------------------------------------------------------------------


class Interrupted(Exception):
    """The worker is stopping (SIGTERM, Ctrl-C): the job stops at its next safe point.

    Not an OSError or a Docker error on purpose: the sandbox must let it through, remove the
    container, and re-raise it.
    """


class Hooks:
    """How a worker steers one job. This default never interrupts (a plain `run_one` call)."""

    def check(self) -> None:
        """Raise Interrupted (worker stopping) or LeaseLost (claim reaped) to stop the job."""

    def before_start(self) -> None:
        """Last chance to stop before the side-effect boundary; a draining worker stops here."""
        self.check()

    def timings(self) -> dict[str, float]:
        """Seconds this task cost before `run_one` (the process's start-up, the claim), first in
        the record's `timings`."""
        return {}


RETRY_HINT = "`fila retry ID` runs it again from a clean copy, `fila reject ID` drops it."


class _Run:
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
            self.removals.pop(0).wait()
            now = time.monotonic()
            for phase in ("run", "remove"):
                self.timings[phase] = round(self.timings.get(phase, 0.0) + now - self.mark, 3)
            self.mark = now

    def settle_removals(self) -> None:
        """await_removal on a path that failed already (a bug, a lost lease), whatever way the
        job ended and before its directory is free again: a removal that failed too becomes a
        warning of the record it publishes (recovery removes what is left by its labels)."""
        while self.removals:
            try:
                self.removals.pop(0).wait()
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
    run = _Run(root, claim, backend, progress, hooks, rec.attempt)
    run.mark = t0
    run.lap("begin")  # the task file read and checked, the running record written
    progress(f"{tid}: claimed (attempt {rec.attempt})")
    try:
        hooks.check()
        checked = check_task(root, task, tags_of=backend.tags)
        # Every image the job may need, before any container: a missing fallback image is found
        # now, not after the first engine ran out of quota.
        need = [*checked.chain, *([("shell", get_engine("shell").image_tag())] if task.check else [])]
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
                return _run_engines(run, checked, refs, rec.attempt, t0)
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
                error=ErrorInfo(kind=ErrorKind.invalid, message=f"Docker refused this task: {refusal}"),
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
            diagnosis=f"Docker failed while the container ran: {e}. work/ may hold "
            f"a partial change. {RETRY_HINT}",
        )
    except (FilaError, OSError) as e:
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


def _run_engines(
    run: _Run, checked: Checked, refs: dict[str, ImageRef], attempt: int, t0: float
) -> Record | None:
    from ..sandbox import RunSpec
    from ..workspace import diff

    root, tid, task = run.root, run.tid, checked.task
    engines = list(checked.chain)
    for i, (name, image) in enumerate(engines):
        engine = get_engine(name)
        ref = refs[image]
        started_at = now_iso()
        run.fence()  # under the job lock: a reaped zombie never wipes a later attempt's job dir
        if i == 0 and attempt > 1:
            _no_earlier_container(run)
        # A fresh copy for every engine: a fallback never sees what the engine before it left.
        prep, mounted, workspace = _prepare(run, checked)
        run.lap("prepare")
        crash_point("after_job_dir")
        run.hooks.check()
        run.progress(f"{tid}: prepared {prep.files} files ({prep.bytes} bytes); running {name}")
        inv = engine.invocation_for(task, checked.policy)  # the policy's deny rules, as the CLI's own
        creds = engine.credentials()[0]
        # Every credential the run knows is kept out of the log, the diff and the record.
        scanner = scanner_for(engine, task, checked.policy)
        if checked.policy.network == "allowlist":
            creds = {}  # the gateway holds the real keys; the engine gets the placeholder (still redacted)
        spec = RunSpec(
            job_id=tid,
            workspace=mounted,
            image=image,
            argv=inv.argv,
            env={**inv.env, **creds},
            # This engine's gateway holds this engine's keys only, not its fallbacks'.
            policy=checked.policy if engine.any_route else egress.only_routes(checked.policy, engine.routes),
            limits=checked.effective.limits,
            timeout_ms=checked.effective.timeout_ms,
            log_path=root.log_path(tid),
            labels={"fila.root": str(root.path), "fila.worker": run.claim.worker},
            redact=scanner.values,
            egress_dir=root.meta(tid) / "egress",
            defer_removal=True,  # the container is removed while the diff runs: awaited below
        )

        image_ref = ImageRef(tag=image, id=ref.id)
        marks: dict[str, float] = {}

        def before_start(
            container_id: str, engine_name: str = name, image_ref: ImageRef = image_ref, marks: dict = marks
        ) -> None:
            run.hooks.before_start()
            # The flag first: if the checkpoint's outcome is unknown, assume it started.
            run.container_started = True
            run.checkpoint(
                container=container_id,
                container_started=True,
                engine=engine_name,
                image=image_ref,
                policy=checked.policy_ref,
                event="container started",
            )
            crash_point("after_checkpoint")
            # The sandbox starts the container as soon as this returns: re-check the fence, so a
            # worker frozen since its checkpoint whose claim was reaped meanwhile stops here.
            run.fence()
            marks["start"] = time.monotonic()  # the backend starts the container now

        t = run.mark
        run.watch = _quota_watch(spec, engine, engines, i)
        try:
            result = run.backend.run(
                spec,
                before_start=before_start,
                heartbeat=run.heartbeat,
                heartbeat_s=HEARTBEAT_IN_RUN_S,
            )
        finally:
            run.watch = None
        if result.removal is not None:
            run.removals.append(result.removal)
        run.lap("run")
        run.split_run(t, marks.get("start"), result.duration_s)
        queue.log_event(
            root,
            tid,
            "container exited",
            engine=name,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            seconds=result.duration_s,
            **({"cut_short": result.stopped} if result.stopped else {}),
        )
        crash_point("after_exit")
        # The engine's words reach the record (error, report, egress log, names): none of them
        # may carry a credential, whatever path it took to the engine.
        in_record: Counter[str] = Counter()
        outcome = scanner.scrub(_classify(engine, result, root.log_path(tid), checked), in_record)
        result.egress = scanner.scrub(result.egress, in_record)
        result.warnings = scanner.scrub(result.warnings, in_record)
        budget = egress.budget_message(result.egress)
        if budget and outcome.kind != "success":
            outcome = _Out(ErrorKind.quota, f"{budget}; {outcome.msg}", outcome.report)
        # Only the engine's own quota falls back: the job's egress budget is spent for every engine
        # (a new one would get no new budget), and auth or an engine error would fail again.
        if outcome.kind == ErrorKind.quota and i + 1 < len(engines) and not budget:
            run.await_removal()  # before the next engine's job directory is made
            _fall_back(run, checked, i, result, outcome, ImageRef(tag=image, id=result.image_id or ref.id),
                       started_at)  # fmt: skip
            continue
        warnings = [*prep.warnings, *result.warnings]
        if budget:
            warnings.append(budget)
        warnings += egress.scrub_messages(result.egress)  # the engine never saw it; the upstream echoes
        diff_fields: dict[str, Any] = {}
        diff_error: str | None = None
        try:
            d = diff.compute_diff(
                prep.job_dir,
                policy=checked.policy,
                scratch=root.meta(tid) / "scratch",
                skip=jobdir.diff_skip(root, checked.project, checked.policy),
                layers=mounted.layers(),
                credentials=scanner,
            )
            diff_fields = {
                "diffstat": scanner.scrub(d.stat, in_record),
                "patch_sha256": d.sha256,
                "patch_path": str(d.patch_path.relative_to(root.path)),
                # A path that is itself a credential is masked here too (apply then refuses it).
                "credentials_in_diff": scanner.scrub(d.credentials, in_record),
            }
            warnings += scanner.scrub(d.warnings, in_record)
            if d.credentials is not None:
                warnings.append(secretscan.diff_warning(d.credentials.counts, len(d.credentials.files)))
        except (LimitExceeded, FilaError) as e:
            diff_error = scanner.scrub(str(e), in_record)
        run.lap("diff")
        crash_point("after_diff")
        if result.log_truncated and not any(w.startswith("log incomplete") for w in warnings):
            warnings.append(f"log truncated at max_log_bytes {checked.policy.max_log_bytes}")
        if diff_error and outcome.kind == "success":
            outcome = _Out(ErrorKind.engine_error, f"the engine's output breaks a limit: {diff_error}")
        check = None
        if task.check and outcome.kind == "success":
            from .check import run_check

            # The same sandbox as the engine's (run.backend), on a copy of work/.
            check = run_check(
                run, task, checked.policy, checked.effective, prep.job_dir, refs, redact=spec.redact
            )
            check = scanner.scrub(check, in_record)
            run.lap("check")
        if in_record:
            warnings.append(f"known credential in the engine's output ({secretscan.counted(in_record)}): "
                            "replaced in the record by its marker")  # fmt: skip
        if scanner.skipped:
            warnings.append(f"not looked for in the log, the diff or the record (shorter than "
                            f"{secretscan.MIN_CHARS} characters): {', '.join(scanner.skipped)}")  # fmt: skip
        run.await_removal()
        run.timings["total"] = round(run.mark - t0, 3)  # the laps since the claim, added up
        ran_on = ImageRef(tag=image, id=result.image_id or ref.id)
        common = dict(
            engine=name,
            model=task.model,
            exit_code=result.exit_code,
            image=ran_on,
            policy=checked.policy_ref,
            container=result.container_name,
            log_path=str(root.log_path(tid).relative_to(root.path)),
            warnings=warnings,
            egress=result.egress,
            backend=result.backend or run.backend.name,
            waived=result.waived,
            engine_report=outcome.report,
            check=check,
            workspace=workspace,
            **diff_fields,
        )
        cur = queue.get_record(root, tid)
        attempts = list(cur.attempts)
        if attempts:
            attempts[-1] = attempts[-1].model_copy(
                update={
                    "ended_at": now_iso(),
                    "outcome": "success" if outcome.kind == "success" else "failed",
                    "engine": name,
                    "error": None
                    if outcome.kind == "success"
                    else ErrorInfo(kind=outcome.kind, message=outcome.msg),
                }
                | _ran(result, outcome, ran_on, root.log_path(tid).relative_to(root.path))
            )
        if outcome.kind == "success":
            return run.finish(Status.needs_review, attempts=attempts, error=None, **common)
        return run.finish(
            Status.failed,
            attempts=attempts,
            error=ErrorInfo(kind=outcome.kind, message=outcome.msg),
            **common,
        )
    raise AssertionError("unreachable: the last engine always finishes")


def _quota_watch(spec: RunSpec, engine: Engine, engines: list[tuple[str, str]], i: int) -> QuotaWatch | None:
    """With a fallback engine after engine i and a gateway to read, the watch that ends engine i's
    run at its upstream's first quota answer on one of its own model routes (docs/engines.md,
    "Falling back promptly"); else None, and the engine's own retries stand. An engine without
    routes of its own (shell) is not watched: its classification never reads the gateway's 429."""
    if i + 1 >= len(engines) or not engine.routes:
        return None
    if spec.policy.network != "allowlist" or spec.egress_dir is None:
        return None
    from .quota_watch import QuotaWatch, gateway_log

    return QuotaWatch(gateway_log(spec.egress_dir), engine.routes, then=engines[i + 1][0])


def _no_earlier_container(run: _Run) -> None:
    """A later attempt (`fila retry`, a requeue) starts only once no container of the task is
    left: an earlier attempt's engine that could not be removed must never run beside a new
    one, nor have its mounted layer wiped by the new job directory. A first attempt has none."""
    try:
        boxes = run.backend.find(job_id=run.tid, root=str(run.root.path))
    except FilaError as e:
        raise InfraError(
            f"could not check that no earlier container of the task is left: {e}", task_id=run.tid
        ) from e
    if boxes:
        raise InfraError(
            f"container {boxes[0].describe()} of an earlier attempt is still there; this attempt "
            "waits until it is gone",
            task_id=run.tid,
            hint="`fila recover` removes it (the task is requeued and runs after)",
        )


def _prepare(run: _Run, checked: Checked) -> tuple[jobdir.Prepared, JobWorkspace, Workspace]:
    """input/ and work/ by the strategy this backend and task allow (snapshot.choose): an overlay
    of a shared snapshot when the backend mounts one, else the copy; the record says which and why."""
    from ..sandbox.base import run_as
    from ..workspace import snapshot
    from ..workspace.strategy import CopyWorkspace, OverlayWorkspace

    root, tid, task = run.root, run.tid, checked.task
    strategy, why = snapshot.choose(root, run.backend.overlay_unsupported())
    if strategy == "overlay" and task.check:
        strategy, why = "copy", "the task's check runs on a copy of work/ made on the host"
    if strategy == "copy":
        prep = jobdir.prepare(root, tid, task, checked.policy, checked.effective)
        return prep, CopyWorkspace(prep.job_dir), Workspace(strategy="copy", why=why)
    owner = run_as() if os.getuid() == 0 else None  # the engine's uid must write its view of the files
    # A rootless overlay's scratch an earlier attempt left (its worker killed between its
    # container's removal and the scratch's) is the subordinate uids': only the backend can empty
    # it. Not done: prepare_job's removal then fails as this task's own error, with the hint.
    with contextlib.suppress(FilaError, OSError, ValueError):
        run.backend.clear_job_scratch(str(root.path), tid)
    prep, overlay, snap = snapshot.prepare_job(
        root, tid, task, checked.policy, checked.effective, owner=owner
    )
    ws = Workspace(
        strategy="overlay", why=why, snapshot=snap.key, snapshot_how=snap.how, files_read=snap.hashed
    )
    return prep, OverlayWorkspace(prep.job_dir, overlay), ws


def _fall_back(
    run: _Run, checked: Checked, i: int, result: Any, outcome: _Out, image: ImageRef, started_at: str
) -> None:
    """Record engine i's quota as an attempt of its own (with its log kept aside), and hand the
    open attempt to the next engine."""
    root, tid = run.root, run.tid
    name, nxt = checked.chain[i][0], checked.chain[i + 1][0]
    # Named by run and engine: a retried task's second run never overwrites the first run's logs.
    kept = root.logs_dir / f"{tid}.{run.attempt}-{i + 1}-{name}.log"
    with contextlib.suppress(FileNotFoundError):
        os.replace(root.log_path(tid), kept)
    cur = queue.get_record(root, tid)
    # The open attempt (numbered at the claim, or at the fallback before) is this engine's.
    done = cur.attempts[-1].model_copy(
        update=_ran(result, outcome, image, kept.relative_to(root.path))
        | {
            "engine": name,
            "worker": run.claim.worker,
            "started_at": started_at,
            "ended_at": now_iso(),
            "outcome": "quota",
            "error": ErrorInfo(
                kind=ErrorKind.quota, message=outcome.msg.replace(str(root.log_path(tid)), str(kept))
            ),
        }
    )
    open_attempt = Attempt(
        number=len(cur.attempts) + 1,
        run=run.attempt,
        engine=nxt,
        worker=run.claim.worker,
        started_at=now_iso(),
    )
    run.checkpoint(attempts=[*cur.attempts[:-1], done, open_attempt], engine=nxt, event="fallback")
    queue.log_event(root, tid, "fell back", engine=name, to=nxt, reason=outcome.msg)
    cut = f" (cut short after {result.duration_s:g} s)" if result.stopped else ""
    run.progress(f"{tid}: {name} is out of quota{cut}; falling back to {nxt}")


@dataclass(frozen=True)
class _Out:
    kind: Any
    msg: str
    report: EngineReport | None = None


def _ran(result: RunResult, outcome: _Out, image: ImageRef, log_path: Path) -> dict[str, Any]:
    """What an attempt's engine ran on and left: its own fields in the record's `attempts`."""
    return {
        "image": image,
        "exit_code": result.exit_code,
        "log_path": str(log_path),
        "egress": result.egress,
        "engine_report": outcome.report,
        "duration_s": result.duration_s,
        "cut_short": result.stopped,
    }


def _classify(engine: Engine, result: Any, log_path: Path, checked: Checked) -> _Out:
    secs = checked.effective.timeout_ms / 1000
    if result.timed_out:
        return _Out(
            ErrorKind.timeout,
            f"timed out after {secs:g} s (task timeout); stopped, "
            f"killed after the {checked.policy.grace_ms} ms grace",
        )
    if result.limit_exceeded:
        return _Out(ErrorKind.engine_error, f"killed: {result.limit_exceeded}")
    if result.oom_killed:
        mem = checked.effective.limits.memory or checked.policy.memory
        return _Out(ErrorKind.engine_error, f"killed: out of memory (limit {mem})")
    # The CLI's structured output (its stdout, apart from stderr) first, then its text, then the
    # gateway's statuses (engines.md); the log file is for people and keeps both streams.
    o = engine.classify_run(result.exit_code, result.output, result.egress)
    report = EngineReport.model_validate(o.report) if o.report else None
    if result.stopped:  # fila stopped it at the upstream's quota answer: that answer is its class
        return _Out(ErrorKind.quota, f"{result.stopped}; see {log_path}", report)
    if o.kind == "success":
        return _Out("success", "", report)
    kind = {"quota": ErrorKind.quota, "auth": ErrorKind.auth}.get(o.kind, ErrorKind.engine_error)
    return _Out(kind, f"{o.message}; see {log_path}", report)


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
