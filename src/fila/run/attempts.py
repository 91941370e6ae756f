"""The engine attempts of one task (docs/architecture.md, "The cycle", steps 3-6): for each engine
of the fallback chain a fresh job directory, the container's run, its classification, and on the
engine's own quota the next engine; the last engine's diff, check and record.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import FilaError, InfraError, LimitExceeded
from ..core.faults import crash_point
from ..core.models import (
    Attempt,
    EngineReport,
    ErrorInfo,
    ErrorKind,
    ImageRef,
    Record,
    Status,
    Workspace,
    now_iso,
)
from ..egress import config as egress
from ..engines import Engine, get_engine, scanner_for
from ..queue import store as queue
from ..workspace import jobdir, secretscan
from .claimed import JobRun
from .intake import Checked

if TYPE_CHECKING:
    from ..sandbox.base import RunResult, RunSpec
    from ..workspace.strategy import JobWorkspace
    from .quota_watch import QuotaWatch

HEARTBEAT_IN_RUN_S = 1.0  # how often the sandbox calls back: the lease, and a stop request


def run_engines(
    run: JobRun, checked: Checked, refs: dict[str, ImageRef], attempt: int, t0: float
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
        if checked.environment is not None:  # the environment's PATH: the engine's prefix, then the project's
            inv.env.pop("PATH", None)
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
            volumes=list(checked.volumes),
        )

        image_ref = ImageRef(tag=image, id=ref.id)
        marks: dict[str, float] = {}

        def before_start(
            container_id: str, engine_name: str = name, image_ref: ImageRef = image_ref, marks: dict = marks
        ) -> None:
            run.hooks.before_start(container_id)
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
        run.add_parts(result.gateway_timings)
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
        warnings += egress.learning_messages(result.egress)  # egress.learn: said plainly, with what
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
                run, task, checked.policy, checked.effective, prep.job_dir, refs, redact=spec.redact,
                image=checked.check_image, volumes=list(checked.volumes),
            )  # fmt: skip
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
            environment=checked.environment,
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
            done = run.finish(Status.needs_review, attempts=attempts, error=None, **common)
            if done is not None:
                run.attest(done, checked.policy)
            return done
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


def _no_earlier_container(run: JobRun) -> None:
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


def _prepare(run: JobRun, checked: Checked) -> tuple[jobdir.Prepared, JobWorkspace, Workspace]:
    """input/ and work/ by the strategy this backend and task allow (overlay.choose): an overlay
    of a shared snapshot when the backend mounts one, else the copy; the record says which and why."""
    from ..sandbox.base import run_as
    from ..workspace.overlay import choose, prepare_job
    from ..workspace.strategy import CopyWorkspace, OverlayWorkspace

    root, tid, task = run.root, run.tid, checked.task
    strategy, why = choose(root, run.backend.overlay_unsupported())
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
    prep, overlay, snap = prepare_job(root, tid, task, checked.policy, checked.effective, owner=owner)
    ws = Workspace(
        strategy="overlay", why=why, snapshot=snap.key, snapshot_how=snap.how, files_read=snap.hashed
    )
    return prep, OverlayWorkspace(prep.job_dir, overlay), ws


def _fall_back(
    run: JobRun, checked: Checked, i: int, result: Any, outcome: _Out, image: ImageRef, started_at: str
) -> None:
    """Record engine i's quota as an attempt of its own (with its log kept aside), and hand the
    open attempt to the next engine."""
    root, tid = run.root, run.tid
    name, nxt = checked.chain[i][0], checked.chain[i + 1][0]
    # Named by run and engine: a retried task's second run never overwrites the first run's logs.
    kept = root.kept_log_path(tid, run.attempt, i + 1, name)
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
