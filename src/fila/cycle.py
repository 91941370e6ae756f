"""The cycle (cycle.md steps 1-7): submit, claim, prepare, run, diff, record, stop.

`run_one` takes one claimed task to a final record. It never touches the project: after the
record is written, nothing happens until a person decides (`fila apply` / `fila reject`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fsutil, jobdir, queue
from .engines import Engine, get_engine
from .errors import (
    DockerUnavailable,
    FilaError,
    ImageMissing,
    InfraError,
    InvalidInput,
    InvalidPolicy,
    InvalidTaskFile,
    LimitExceeded,
    TargetError,
)
from .layout import Root
from .models import (
    Attempt,
    ErrorInfo,
    ErrorKind,
    ImageRef,
    Policy,
    PolicyRef,
    Record,
    Status,
    Task,
    now_iso,
)
from .policy import Effective, image_allowed, load_json, load_policy, narrow, validate_document

if TYPE_CHECKING:
    import docker

MAX_INFRA_ATTEMPTS = 5
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0


class LeaseLost(Exception):
    """The claim file is gone (recovery reaped it): this worker must not publish."""


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


def parse_task_file(path: Path, *, expected_id: str | None = None) -> Task:
    data = load_json(path, "task")
    validate_document("task", data, path=path)
    task = Task.model_validate(data)
    if expected_id and task.id and task.id != expected_id:
        raise InvalidTaskFile(
            f"id {task.id!r} differs from the file name's {expected_id!r}", field="id", path=path
        )
    return task


def check_task(root: Root, task: Task) -> Checked:
    """Everything that can be known to be wrong before a container exists."""
    engine = get_engine(task.engine)
    engine.config(task)
    for name in task.fallback:
        get_engine(name).config(task)
    policy, ref = load_policy(root, task.policy)
    eff = narrow(policy, task, name=task.policy)
    project = jobdir.project_of(root, task)
    if not project.is_dir():
        raise TargetError("project directory does not exist", path=project)
    targets = jobdir.resolve_targets(root, project, task.targets, policy)
    image = task.image or engine.image_tag()
    if not image_allowed(policy, image):
        raise InvalidPolicy(
            f"image {image!r} is not allowed by policy {task.policy!r} ({', '.join(policy.images)})"
        )
    return Checked(task, engine, policy, ref, eff, project, targets, image)


def submit(root: Root, task: Task) -> Record:
    root.require()
    check_task(root, task)
    return queue.enqueue(root, task.id or queue.new_task_id(), task)


# -- running one task ------------------------------------------------------------------------


def _tail(path: Path, n: int = 16_384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def backoff_s(attempt: int) -> float:
    """Exponential backoff with full jitter, capped."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1)))


class _Run:
    """State of one claimed task while it runs; `finish` publishes exactly once."""

    def __init__(self, root: Root, claim: queue.Claim, client: Any, progress: Callable[[str], None]):
        self.root, self.claim, self.client, self.progress = root, claim, client, progress
        self.tid = claim.task_id
        self.timings: dict[str, float] = {}
        self.fields: dict[str, Any] = {}
        self.container_started = False

    def checkpoint(self, **fields: Any) -> None:
        self.fields.update(fields)
        queue.set_status(self.root, self.tid, Status.running, expect={Status.running},
                         event="checkpoint", **fields)

    def heartbeat(self) -> None:
        if not queue.heartbeat(self.claim):
            raise LeaseLost(self.tid)

    def finish(self, status: Status, **fields: Any) -> Record | None:
        """Publish the outcome: pending result first (recovery can finish it), then the race."""
        fields = {**fields, "timings": self.timings}
        meta = self.root.meta(self.tid)
        meta.mkdir(parents=True, exist_ok=True)
        fsutil.atomic_write(meta / "result.json", json.dumps(
            {"status": status, "fields": _jsonable(fields)}, indent=1))
        if not queue.win(self.claim, "done"):
            queue.log_event(self.root, self.tid, "result discarded", reason="lease lost",
                            worker=self.claim.worker)
            return None
        rec = queue.set_status(self.root, self.tid, status, expect={Status.running}, **fields)
        queue.release(self.claim, "done")
        return rec

    def hand_back(self, err: FilaError, attempt: int) -> Record | None:
        """Before the container started: requeue with backoff, or fail after too many tries."""
        if attempt >= MAX_INFRA_ATTEMPTS:
            return self.finish(Status.failed, error=ErrorInfo(
                kind=ErrorKind.infra, message=f"{err} (gave up after {attempt} attempts)"))
        if not queue.hand_back(self.root, self.claim):
            return None
        return queue.set_status(
            self.root, self.tid, Status.queued, expect={Status.running}, event="requeued",
            not_before=time.time() + backoff_s(attempt),
            error=ErrorInfo(kind=ErrorKind.infra, message=str(err)), worker=None,
        )


def _jsonable(fields: dict[str, Any]) -> Any:
    from pydantic_core import to_jsonable_python

    return to_jsonable_python(fields)


def run_one(root: Root, claim: queue.Claim, *, client: docker.DockerClient,
            progress: Callable[[str], None] = lambda _m: None) -> Record | None:
    """Take one claimed task to its record. Returns None when the lease was lost to recovery."""
    from . import images  # docker is imported only when something runs

    run = _Run(root, claim, client, progress)
    tid = run.tid
    t0 = time.monotonic()
    rec = queue.read_record(root, tid)
    try:
        task = parse_task_file(claim.path, expected_id=tid)
    except InvalidInput as e:
        kept = queue.reject_file(root, claim.path, str(e), name=f"{tid}.json")
        err = ErrorInfo(kind=ErrorKind.invalid, message=f"{e} (file kept as {kept})")
        return queue.set_status(root, tid, Status.failed, event="rejected", error=err)
    if rec is None:  # dropped straight into fila/in/: it is submitted by being claimed
        rec = queue.set_status(root, tid, Status.queued, task=task, event="submitted")
    attempt = rec.attempt + 1
    queue.set_status(
        root, tid, Status.running, expect={Status.queued}, task=task, worker=claim.worker,
        attempt=attempt, not_before=None, error=None,
        attempts=[*rec.attempts, Attempt(number=attempt, engine=task.engine,
                                         worker=claim.worker, started_at=now_iso())],
    )
    progress(f"{tid}: claimed (attempt {attempt})")
    try:
        checked = check_task(root, task)
        ref = images.find_image(client, checked.image)
        if ref is None:
            raise ImageMissing(
                f"image {checked.image} is not built", task_id=tid,
                hint=f"run `fila images build {task.engine}`",
            )
        return _run_engines(run, checked, ref, attempt, t0)
    except InvalidInput as e:
        return run.finish(Status.failed, error=ErrorInfo(kind=ErrorKind.invalid, message=str(e)))
    except LimitExceeded as e:
        return run.finish(Status.failed, error=ErrorInfo(kind=ErrorKind.invalid, message=str(e)))
    except LeaseLost:
        queue.log_event(root, tid, "result discarded", reason="lease lost", worker=claim.worker)
        return None
    except InfraError as e:
        if not run.container_started:
            run.hand_back(e, attempt)
            raise
        return run.finish(Status.needs_human, error=ErrorInfo(kind=ErrorKind.infra, message=str(e)),
                          diagnosis=f"Docker failed while the container ran: {e}. work/ may hold "
                                    "a partial change; retry or reject.")
    except BaseException as e:  # Ctrl-C, SIGTERM, bugs: never leave a running record behind
        msg = f"interrupted: {type(e).__name__}: {e}".rstrip(": ")
        if run.container_started:
            run.finish(Status.needs_human, error=ErrorInfo(kind=ErrorKind.interrupted, message=msg),
                       diagnosis="the worker stopped while the container ran; it was removed. "
                                 "`fila retry ID` runs it again, `fila reject ID` drops it.")
        else:
            run.hand_back(InfraError(msg), attempt)
        raise


def _run_engines(run: _Run, checked: Checked, ref: Any, attempt: int, t0: float) -> Record | None:
    from . import diff, sandbox

    root, tid, task = run.root, run.tid, checked.task
    engines = [task.engine, *task.fallback]
    attempts_done: list[Attempt] = []
    for i, name in enumerate(engines):
        engine = get_engine(name)
        image = checked.image if i == 0 else (task.image or engine.image_tag())
        if i > 0:
            from . import images
            ref = images.find_image(run.client, image)
            if ref is None:
                raise ImageMissing(f"fallback image {image} is not built", task_id=tid,
                                   hint=f"run `fila images build {name}`")
        t = time.monotonic()
        prep = jobdir.prepare(root, tid, task, checked.policy, checked.effective)
        run.timings["prepare"] = round(time.monotonic() - t, 3)
        run.progress(f"{tid}: prepared {prep.files} files ({prep.bytes} bytes); running {name}")
        inv = engine.invocation(task)
        creds, secrets = engine.credentials()
        spec = sandbox.RunSpec(
            job_id=tid, job_dir=prep.job_dir, image=image, argv=inv.argv,
            env={**inv.env, **creds}, policy=checked.policy, limits=checked.effective.limits,
            timeout_ms=checked.effective.timeout_ms, log_path=root.log_path(tid),
            labels={"fila.root": str(root.path), "fila.worker": run.claim.worker},
            redact=[*inv.secrets, *secrets],
        )

        image_ref = ImageRef(tag=image, id=ref.id)

        def before_start(container_id: str, engine_name: str = name,
                         image_ref: ImageRef = image_ref) -> None:
            run.container_started = True
            run.checkpoint(container=container_id, container_started=True, engine=engine_name,
                           image=image_ref, policy=checked.policy_ref)

        t = time.monotonic()
        result = sandbox.run(spec, client=run.client, before_start=before_start,
                             heartbeat=run.heartbeat)
        run.timings["run"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        warnings = list(prep.warnings)
        diff_fields: dict[str, Any] = {}
        diff_error: str | None = None
        try:
            d = diff.compute_diff(prep.job_dir, policy=checked.policy,
                                  scratch=root.meta(tid) / "scratch")
            diff_fields = {"diffstat": d.stat, "patch_sha256": d.sha256,
                           "patch_path": str(d.patch_path.relative_to(root.path))}
            warnings += d.warnings
        except (LimitExceeded, FilaError) as e:
            diff_error = str(e)
        run.timings["diff"] = round(time.monotonic() - t, 3)
        run.timings["total"] = round(time.monotonic() - t0, 3)
        if result.log_truncated:
            warnings.append(f"log truncated at max_log_bytes {checked.policy.max_log_bytes}")
        common = dict(
            engine=name, model=task.model, exit_code=result.exit_code,
            image=ImageRef(tag=image, id=result.image_id or ref.id), policy=checked.policy_ref,
            container=result.container_name, log_path=str(root.log_path(tid).relative_to(root.path)),
            warnings=warnings, **diff_fields,
        )
        outcome = _classify(engine, result, root.log_path(tid), checked)
        if diff_error and outcome.kind == "success":
            outcome = _Out(ErrorKind.engine_error, f"the engine's output breaks a limit: {diff_error}")
        if outcome.kind == ErrorKind.quota and i + 1 < len(engines):
            attempts_done.append(Attempt(number=attempt, engine=name, worker=run.claim.worker,
                                         ended_at=now_iso(), outcome="quota",
                                         error=ErrorInfo(kind=ErrorKind.quota, message=outcome.msg)))
            cur = queue.get_record(root, tid)
            run.checkpoint(attempts=[*cur.attempts, *attempts_done[-1:]], engine=engines[i + 1])
            run.progress(f"{tid}: {name} is out of quota; falling back to {engines[i + 1]}")
            continue
        cur = queue.get_record(root, tid)
        attempts = list(cur.attempts)
        if attempts:
            attempts[-1] = attempts[-1].model_copy(update={
                "ended_at": now_iso(), "outcome": "success" if outcome.kind == "success" else "failed",
                "engine": name,
                "error": None if outcome.kind == "success" else ErrorInfo(kind=outcome.kind,
                                                                          message=outcome.msg)})
        if outcome.kind == "success":
            return run.finish(Status.needs_review, attempts=attempts, error=None, **common)
        return run.finish(Status.failed, attempts=attempts,
                          error=ErrorInfo(kind=outcome.kind, message=outcome.msg), **common)
    raise AssertionError("unreachable: the last engine always finishes")


@dataclass(frozen=True)
class _Out:
    kind: Any
    msg: str


def _classify(engine: Engine, result: Any, log_path: Path, checked: Checked) -> _Out:
    secs = checked.effective.timeout_ms / 1000
    if result.timed_out:
        return _Out(ErrorKind.timeout, f"timed out after {secs:g} s (task timeout); stopped, "
                                       f"killed after the {checked.policy.grace_ms} ms grace")
    if result.oom_killed:
        mem = checked.effective.limits.memory or checked.policy.memory
        return _Out(ErrorKind.engine_error, f"killed: out of memory (limit {mem})")
    o = engine.classify(result.exit_code, _tail(log_path))
    if o.kind == "success":
        return _Out("success", "")
    kind = {"quota": ErrorKind.quota, "auth": ErrorKind.auth}.get(o.kind, ErrorKind.engine_error)
    return _Out(kind, f"{o.message}; see {log_path}")


# -- processing the queue --------------------------------------------------------------------


def next_claim(root: Root, worker: str) -> queue.Claim | None:
    now = time.time()
    for path in queue.queued_files(root):
        rec = queue.read_record(root, path.stem) if queue.valid_id(path.stem) else None
        if rec and rec.not_before and rec.not_before > now:
            continue
        c = queue.try_claim(root, path, worker)
        if c:
            return c
    return None


def earliest_backoff(root: Root) -> float | None:
    waits = []
    for path in queue.queued_files(root):
        rec = queue.read_record(root, path.stem) if queue.valid_id(path.stem) else None
        if rec and rec.not_before:
            waits.append(rec.not_before)
    return min(waits) if waits else None


def run_queue(root: Root, *, worker: str | None = None, client: Any = None,
              on_record: Callable[[Record], None] = lambda _r: None,
              progress: Callable[[str], None] = lambda _m: None) -> list[Record]:
    """Process what is queued, waiting out backoffs, then return (`fila run --once`)."""
    from . import sandbox

    root.require()
    worker = worker or queue.new_worker_id()
    client = client or sandbox.docker_client()  # unreachable: raise before claiming anything
    done: list[Record] = []
    while True:
        claim = next_claim(root, worker)
        if claim is None:
            wake = earliest_backoff(root)
            if wake is None:
                return done
            time.sleep(max(0.05, min(wake - time.time(), BACKOFF_CAP_S)))
            continue
        try:
            rec = run_one(root, claim, client=client, progress=progress)
        except DockerUnavailable:
            raise
        if rec is not None and rec.status != Status.queued:
            done.append(rec)
            on_record(rec)
