"""A runner of the PostgreSQL queue: `fila worker --queue URL` (docs/scale-out.md,
docs/architecture.md "The PostgreSQL queue").

It claims from the database only tasks of the engines this host has, lays the task's targets
out from their blobs (run/remote_inputs.py) in a job root of its own under its local root
(`<root>/remote/<id>.<token>`, a queue root with this host's policies: secrets stay here), and
runs the task there through the one run path (job.run_one), exactly as a file-queue worker does.
The database is told what only the queue may record, through the lease's token:

- `mark_started` just before the container starts (the hooks' `before_start`): from then on a
  lost lease sends the task to needs_human, never silently run again;
- the lease renewed from a heartbeat thread; a renewal refused (LeaseLost) or not answered
  before the lease runs out stops the job at its next check (the container is stopped) and
  nothing is published;
- the outcome (RESULT_FIELDS of the local record) and the blobs a reviewer needs (DIFF.patch, the
  log, the input manifest, the job's events) in one publish, which a stale token cannot make
  (run/remote_publish.py);
- a task handed back before its container started goes back to the queue (`hand_back`).

The job root's own file queue is this runner's journal of the job (its record, claim and events);
the database's record is the one reviewers read.

Up to `concurrency` claims run at once, each in a thread of its own with its own lease, renewer
and job root. Each job root is guarded by a lock the runner takes before it exists and lets go
only after the job root is removed (or kept, its containers stopped or not confirmed removed);
at start, every RECOVER_EVERY_S while it keeps one, and in every `fila recover --root`, the job
roots whose lock nobody holds (an earlier runner process on this root died with them, or this
runner kept them) are recovered: containers, gateway and job root removed
(recovery/remote_jobs.py says who may remove a job root, and when). Nothing is published for
them: the database's lease decides their tasks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import (
    FilaError,
    HostLacks,
    ImageMissing,
    InfraError,
    InvalidPolicy,
    Refused,
    UnknownPolicy,
)
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Record
from ..engines import get_engine
from ..queue import store as queue
from ..queue.pg.store import INPUTS, Lease, PgQueue
from ..queue.policy import load_policy, policy_path
from ..queue.retry import INFRA
from ..recovery import remote_jobs, runner_root
from ..recovery.recover import recover_job_roots
from . import job as cycle
from . import spares
from .lease_hooks import LeaseHooks, Renewer
from .remote_host import check_host, engines_here, policy_lacks, usable_policies
from .remote_inputs import unpack
from .remote_publish import give_back, hand_back, publish, refuse
from .slots import RECOVER_EVERY_S, Slot, SlotLoop

if TYPE_CHECKING:
    from securesystemslib.signer import Signer

    from ..sandbox import Backend

LEASE_S = 30.0  # a claim's lease on the database's clock; renewed every LEASE_S / 3
BEAT_S = 10.0  # a runner's heartbeat in the runners table, between claims
LIVE_S = 60.0  # a runner not seen for this long is not live (`fila status --queue`)
IO_TIMEOUT_S = 120.0  # the longest a runner's database call may block (statement, TCP)
DOWN_MAX_S = 30.0  # the longest wait between tries while the database does not answer
START_RECOVERY_WAIT_S = 60.0  # a runner's start waits this long for another recovery of its root
REFUSAL_CHARS = 400  # a refusal's reason, once redacted, is cut to this in the record


def default_host_id() -> str:
    return f"{socket.gethostname()[:60]}-{os.getpid()}"


def images_of(backend: Backend, engines: list[str]) -> dict[str, str]:
    """engine -> its image as this host has it (tag and id), for the queue's runners table."""
    out = {}
    for name in engines:
        with contextlib.suppress(FilaError):
            tag = get_engine(name).image_tag()
            ref = backend.image(tag)
            out[name] = f"{tag} {ref.id}" if ref is not None and ref.id else tag
    return out


class RemoteWorker(SlotLoop[Slot]):
    """Claims and runs tasks of one queue database from the local root `root`, up to
    `concurrency` at once."""

    def __init__(
        self,
        root: Root,
        url: str,
        *,
        host_id: str | None = None,
        engines: list[str] | None = None,
        policies: list[str] | None = None,
        once: bool = False,
        concurrency: int = 1,
        backend: Backend | None = None,
        lease_s: float = LEASE_S,
        poll_s: float = 1.0,
        reconnect_s: float = 30.0,
        keep: bool = False,
        recover_every_s: float = RECOVER_EVERY_S,
        on_record: Callable[[Record], None] = lambda _r: None,
        progress: Callable[[str], None] = lambda _m: None,
    ) -> None:
        from ..sandbox import get_backend, root_backend

        super().__init__(concurrency=concurrency, once=once, on_record=on_record)
        runner_root.check_root(root)  # before require, which makes directories by path, through links
        self.root, self.url = root.require(), url
        self.id = host_id or default_host_id()
        self.owns_backend = backend is None
        self.backend = backend or get_backend(root_backend(root))
        self.engines = engines
        self.policies = sorted(set(policies)) if policies else None  # None: any policy of the root
        self.claiming: list[str] = []  # the engines it claims (set at start; rebound, never mutated)
        self.takes_lock = threading.Lock()  # a policy or engine left out by one job at a time
        self.own_policies: set[str] = set()  # names whose file is in the root's policies/ (at start)
        self.signer: Signer | None = None  # this host's signing key (run statements), read at start
        self.lease_s, self.poll_s, self.keep = lease_s, poll_s, keep
        self.kept: set[str] = set()  # job roots this runner kept, for its own recovery pass
        self.recover_every_s = recover_every_s
        self.reconnect_s = reconnect_s
        self.progress = progress
        self.cancel = threading.Event()  # a signal: every job stops at its next check
        self.infra_streak = 0  # jobs in a row that ended on a host failure (the wait doubles)
        self.beat: PgQueue | None = None

    def _on_signal(self, sig: int, _frame: Any) -> None:
        self.interrupted = sig == signal.SIGINT
        self.cancel.set()
        self.wake.set()

    def run(self) -> int:
        """Claim and run until the queue has nothing for this host (`once`) or a signal; the exit
        code as `fila run --once`'s."""
        self.backend.ping()
        for name in self.engines or ():
            get_engine(name)  # UnknownEngine names the valid ones
        for name in self.policies or ():
            load_policy(self.root, name)  # a policy this root cannot load is refused before a claim
            why = policy_lacks(self.root, name, self.backend)
            if why:
                raise InfraError(
                    f"policy {name}: {why}",
                    hint="leave it out of --policy, or give this host the runtime or credential it lacks",
                )
        # The policies whose file is this root's own: never run under fila's shipped file of the
        # name if that file goes (run_lease).
        self.own_policies = {p.stem for p in self.root.policies_dir.glob("*.json")}
        # This host's own key signs the run statements of the tasks it runs (docs/provenance.md);
        # one that cannot be read stops the runner before a claim, never a task after its run.
        from ..provenance import keys

        self.signer = keys.signer_of(self.root) if keys.has_signer(self.root) else None
        if self.policies is None:  # what it can run, not "any": a task of another policy stays queued
            self.policies = usable_policies(self.root, self.backend, self.progress)
            if not self.policies:
                raise InfraError(
                    f"no policy of {self.root.policies_dir} can run here: this runner can claim nothing",
                    hint="see the lines above for why each was left out",
                )
        here = engines_here(self.backend)
        engines = self.engines or here
        if not engines:
            raise InfraError(
                f"{self.backend.name} has no engine image; this runner can claim nothing",
                hint="`fila images build ENGINE`, or name the engines with --engine",
            )
        missing = [e for e in engines if e not in here]
        if missing:  # it would claim their tasks only to hand each back
            raise InfraError(
                f"{self.backend.name} has no image of {', '.join(missing)}: this runner cannot run "
                "their tasks",
                hint=f"`fila images build {' '.join(missing)}`, or leave them out of --engine",
            )
        # Spare gateways of an earlier runner process on this root that died with them up, and its
        # job roots (containers, gateway, directory) whose lock nobody holds; then this runner's
        # own spares, for the allowlist policies it takes.
        # Its job roots get recovery's pass; a root or remote/ it could not use refuses here, not
        # at each claim (remote_jobs.py: who may reach remote/).
        runner_root.prepare(self.root)
        for what in self.backend.sweep_spares(self.root.path, self.root.spares_dir):
            self.progress(f"fila worker {self.id}: removed {what} (its runner is gone)")
        # Bounded: a recovery lock held by someone else stops this start with a message, not a hang.
        for a in recover_job_roots(self.root, backend=self.backend, wait_s=START_RECOVERY_WAIT_S).actions:
            self.progress(f"fila worker {self.id}: {a.action}: {a.detail}")
        pool = spares.keep(self.root, self.backend, once=self.once, policies=self.policies)
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        n = self.concurrency
        try:
            # The renewals' own connections, with a retry shorter than a renewal's interval: a
            # database that stops answering is noticed within the lease, not after a long retry.
            beat_s = max(1.0, self.lease_s / 3)
            # Both bounded (io_timeout_s): a call on a silently partitioned network errs, never blocks.
            with (
                PgQueue(
                    self.url, max_size=n + 3, reconnect_s=self.reconnect_s, io_timeout_s=IO_TIMEOUT_S
                ) as q,
                PgQueue(self.url, max_size=n, reconnect_s=beat_s, io_timeout_s=max(2.0, beat_s)) as beat,
            ):
                self.beat = beat
                self.progress(f"fila worker {self.id}: {q.where}, engines {', '.join(engines)}, slots {n}")
                q.runner_up(self.id, engines, images=images_of(self.backend, engines), slots=n,
                            policies=self.policies)  # fmt: skip
                self.claiming = list(engines)
                try:
                    self._loop(q)
                finally:
                    with contextlib.suppress(FilaError):
                        q.runner_down(self.id)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            spares.close(pool, self.backend, self.progress)
            if self.owns_backend:
                self.backend.close()
        if self.crash is not None:
            raise self.crash
        return self.exit_code()

    def _loop(self, q: PgQueue) -> None:
        """Sweep, claim, run, until there is nothing for this host (`once`) or a signal, and every
        job started has ended; the runner's heartbeat in the runners table at most every BEAT_S
        seconds between claims (the leases' renewals beat while tasks run)."""
        try:
            self._claims(q)
        except BaseException:
            # The database did not answer a `--once` runner, or a bug: the jobs stop as on a signal
            # (containers stopped, nothing published for a lost lease) before this ends the runner.
            self.cancel.set()
            raise
        finally:
            self.join()
            self._collect()

    def _claims(self, q: PgQueue) -> None:
        beat_at = kept_at = time.monotonic()
        down_s = self.poll_s  # the wait after the database did not answer, doubled up to DOWN_MAX_S
        while True:
            self._collect()
            if self.cancel.is_set() or self.stop_claiming:
                if not self.active:
                    return
                self.wait(self.poll_s)
                continue
            if time.monotonic() - beat_at >= BEAT_S:
                with contextlib.suppress(FilaError):
                    q.runner_beat(self.id)
                beat_at = time.monotonic()
            if self.kept and time.monotonic() - kept_at >= self.recover_every_s:
                self._recover_kept()
                kept_at = time.monotonic()
            if len(self.active) >= self.concurrency:
                self.wait(self.poll_s)
                continue
            try:
                for tid, st in q.sweep():
                    self.progress(f"{tid}: lease expired: {st}")
                # The claim statement refuses while the breaker is open; this says so, once.
                br = q.breaker()
                if br.open:
                    if not self.breaker_tripped:
                        self.breaker_tripped = True
                        self.progress(f"fila worker {self.id}: circuit breaker open: {br.reason}; "
                                      "run `fila rearm --queue URL`")  # fmt: skip
                    if self.once:
                        self.stop_claiming = True
                    else:
                        self.wait(self.poll_s)
                    continue
                self.breaker_tripped = False
                sent = time.monotonic()  # the lease is counted from here (LeaseHooks)
                engines = self.claiming  # what a job may leave out (leave_out) holds from the next claim
                if self.once or self.active:  # a job that ends wakes this loop: never blocked on a claim
                    lease = q.claim(self.id, engines, self.lease_s, policies=self.policies)
                else:
                    wait_s = min(self.poll_s, self.lease_s / 3)  # the claim sent within it
                    lease = q.claim_wait(self.id, engines, self.lease_s, poll_s=wait_s,
                                         timeout=wait_s, policies=self.policies)  # fmt: skip
                wait = None
                if lease is None and self.once and not self.active:
                    wait = q.backoff_left(engines, policies=self.policies)
            except InfraError as e:  # QueueUnreachable, or a statement that timed out
                if self.once:  # `--once` exits 3 (docs/scale-out.md); a long-running runner waits
                    if not self.active:
                        raise
                    self.progress(f"fila worker {self.id}: {e}")
                    self.infra_error, self.stop_claiming = self.infra_error or e, True
                    continue
                self.progress(f"fila worker {self.id}: {e}; trying again in {down_s:g} s")
                self.cancel.wait(down_s)
                down_s = min(DOWN_MAX_S, down_s * 2)
                continue
            down_s = self.poll_s
            if lease is not None:
                job = functools.partial(self.run_lease, q, lease, sent)
                self.start(f"{lease.task_id}.{lease.token}", Slot(lease.task_id), job)
                continue
            if self.active:
                self.wait(self.poll_s)
            elif self.once:
                if wait is None:  # nothing queued that this runner could ever claim
                    return
                # A task of its engines waits out its backoff: `--once` waits for it, as `fila run
                # --once` does (the database's clock says how long; 0: another runner holds it).
                self.cancel.wait(min(max(wait, 0.05), DOWN_MAX_S))

    def _recover_kept(self) -> None:
        """The job roots this runner kept (a job fenced off, a lost lease, a container the engine
        did not confirm removed) are recovered while it runs, every `recover_every_s`, not only at
        its next start: their locks are free once their jobs ended (remote_jobs.py)."""
        try:
            rep = recover_job_roots(self.root, backend=self.backend, wait=False)
        except (FilaError, OSError) as e:  # tried again at the next round
            self.progress(f"fila worker {self.id}: recovery of its kept job roots failed: {e}")
            return
        for a in rep.actions:
            if a.detail.split(":", 1)[0] in self.kept:
                self.progress(f"fila worker {self.id}: {a.action}: {a.detail}")
        gone = [
            p
            for p in list(self.kept)
            if not any(os.path.lexists(x) for x in (p, remote_jobs.removing(Path(p))))
        ]
        self.kept.difference_update(gone)  # a removal stopped part-way is still this runner's to finish

    def _collect(self) -> None:
        """The jobs that ended: their records said (in this thread, one at a time), their errors
        noted. An InfraError (the host, not the task: handed back or left to its lease) ends a
        `--once` runner's claims; a bug ends every runner's claims and is raised once the other
        jobs have ended."""
        for slot in self.ended():
            e = slot.error
            if isinstance(e, InfraError):
                self.progress(f"{slot.task_id}: {e}")
                self.infra_error = e
                if self.once:
                    self.stop_claiming = True
                else:  # the host is at fault: each failure in a row doubles the wait, to DOWN_MAX_S
                    self.infra_streak += 1
                    wait_s = min(DOWN_MAX_S, self.poll_s * 2 ** (self.infra_streak - 1))
                    self.progress(f"fila worker {self.id}: claiming again in {wait_s:g} s")
                    self.cancel.wait(wait_s)
            elif e is not None:
                self.crash, self.stop_claiming = self.crash or e, True
            elif slot.result is not None:
                self.infra_streak = 0
                self.record(slot.result)

    # -- one claim ------------------------------------------------------------------------------

    def job_root(self, held: remote_jobs.Held) -> Root:
        """A fresh queue root for this claim at `held.path`, with this host's policies and backend
        config. The caller holds its lock (remote_jobs.take made it, empty but for its mark):
        only the lock's holder, or recovery once the lock is free, may write in or remove it."""
        jr = Root(held.path).create()
        for p in sorted(self.root.policies_dir.glob("*.json")):
            if p.is_file() and not p.is_symlink():
                shutil.copy2(p, jr.policies_dir / p.name)
        config = self.root.fila / "config.json"
        if config.is_file():
            shutil.copy2(config, jr.fila / "config.json")
        return jr.require()

    def leave_out(self, q: PgQueue, lease: Lease, jr: Root, e: HostLacks) -> None:
        """A task this host cannot run (e.what: its policy as the host has it, or its engine's
        image, is not what the start found): the host's, not the task's. The task goes back
        uncounted, this runner claims that policy or engine no more (its tasks wait for another
        runner), the runners table says so, and a runner left with nothing to claim stops (exit 3)
        rather than idle while `fila status` calls it live."""
        why = f"{e}" + (f"; {e.hint}" if e.hint else "")
        with self.takes_lock:  # first, so no other slot claims the task again from this runner
            if e.what == "engine":
                self.claiming = [x for x in self.claiming if x != e.name]
            elif self.policies is not None:
                self.policies = [x for x in self.policies if x != e.name]
            engines, policies = self.claiming, self.policies
        give_back(q, lease, jr, f"runner {self.id} cannot run {e.what} {e.name}: {why}")
        with self.takes_lock, contextlib.suppress(FilaError):
            engines, policies = self.claiming, self.policies  # another slot may have left one out since
            q.runner_takes(self.id, engines, images=images_of(self.backend, engines), policies=policies)
        self.progress(f"fila worker {self.id}: {e.what} {e.name} left out from now on (its tasks wait "
                      f"for another runner): {why}")  # fmt: skip
        if not engines or policies == []:
            self.crash = self.crash or InfraError(
                f"runner {self.id} has no {'engine' if not engines else 'policy'} left that it can run: "
                "it claims nothing more",
                hint="see the lines above for why each was left out; mend the host, then start it again",
            )
            self.stop_claiming = True

    def run_lease(self, q: PgQueue, lease: Lease, sent: float | None = None) -> Record | None:
        """Run one claimed task and publish its outcome; None when the lease was lost (nothing
        published). InfraError after handing the task back when the host failed before its
        container started.

        The job root's lock is taken before the job root is made and let go last, after the job
        root is removed, or kept: when the lease was lost (its containers stopped by then: the run
        path stops them before it returns), when the run path fenced the job off (a container it
        could not confirm removed), when the container engine does not confirm that none of its
        containers is left, or with `keep`; a job root kept is removed by the next recovery of
        this root (a runner's start, `fila recover --root`)."""
        tid = lease.task_id
        self.progress(f"{tid}: claimed (attempt {lease.attempt}, token {lease.token})")
        hooks = LeaseHooks(q, lease, self.cancel, self.lease_s, sent)
        renewer = Renewer(self.beat or q, hooks, self.lease_s, None)
        renewer.start()
        jr: Root | None = None
        held: remote_jobs.Held | None = None
        ended = False  # the run path returned a record: its containers removed
        try:
            name = remote_jobs.job_name(tid, lease.token)
            try:
                held = remote_jobs.take(self.root, name)
                held.verify()  # still the directory take made: nothing of the host's goes elsewhere
                jr = self.job_root(held)
            except (FilaError, OSError) as e:
                # This host's disk, not the task, and before any container: the task goes back
                # uncounted (its tries are not this host's to spend) and this ends as an infra
                # error does (`--once` stops claiming, a long-running runner waits).
                err = e if isinstance(e, InfraError) else InfraError(f"task {tid}: its job root: {e}")
                where = Root(held.path if held is not None else runner_root.jobs_dir(self.root) / name)
                give_back(q, lease, where, str(err))
                if held is not None:  # made by this claim, no container ran there
                    with contextlib.suppress(FilaError, OSError):
                        held.verify()
                        remote_jobs.remove(held.path)
                if err is e:
                    raise
                raise err from e
            try:
                manifest = q.blob(q.task_blobs(tid)[INPUTS])
                # The task's policy as this host has it, before anything is written: a manifest
                # over its max_work_files / max_work_bytes is refused unread. It is the root's own
                # file (a link there is refused, never replaced by fila's shipped policy of its
                # name in the job root), as the job root's copy holds it.
                name = lease.task.policy
                if (
                    name in self.own_policies
                    and policy_path(self.root, name).parent != self.root.policies_dir
                ):
                    raise InvalidPolicy(
                        f"policy {name}: this runner's own file of it is gone since its start"
                    )
                _own, own = load_policy(self.root, name)
                pol, ref = load_policy(jr, name)
                if ref.sha256 != own.sha256:
                    raise InvalidPolicy(f"policy {name}: the file changed while the job root was made")
                targets = unpack(q, manifest, jr.path, max_files=pol.max_work_files,
                                 max_bytes=pol.max_work_bytes)  # fmt: skip
            except KeyError:
                why = f"task {tid} has no {INPUTS} blob (queued without its targets)"
                return refuse(q, lease, jr, self.backend.name, why)
            except (InvalidPolicy, UnknownPolicy) as e:  # this host's copy of it, not the task
                why = f"{e}" + (f"; {e.hint}" if e.hint else "")
                return self.leave_out(q, lease, jr, HostLacks("policy", lease.task.policy, why))
            except (InfraError, MemoryError) as e:
                # The database or this host (its disk full, its memory), not the task: the task
                # goes back uncounted (when the database answers; else its lease lapses and a
                # sweep requeues it) and this ends as an infra error does.
                err = (
                    e
                    if isinstance(e, InfraError)
                    else InfraError(f"task {tid}: laying out its targets: {e!r}")
                )
                give_back(q, lease, jr, str(err))
                if err is e:
                    raise
                raise err from e
            except FilaError as e:
                why = f"{e}" + (f"; {e.hint}" if e.hint else "")
                return refuse(q, lease, jr, self.backend.name, why, limit=REFUSAL_CHARS)
            except Exception as e:  # whatever a hostile manifest finds fails its own task, not this runner
                why = f"task {tid}: its targets could not be laid out: {type(e).__name__}: {e!s}"
                return refuse(q, lease, jr, self.backend.name, why, limit=REFUSAL_CHARS)
            task = lease.task.model_copy(update={"id": tid, "project": None, "targets": targets})
            try:
                check_host(
                    jr, task, self.backend
                )  # the host's lacks; the task's own faults are the run path's
                queue.enqueue(jr, tid, task)
                claim = cycle.next_claim(jr, self.id, only={tid})
                if claim is None:
                    raise InfraError(f"task {tid}: its local copy in {jr.path} could not be claimed")
                renewer.claim = claim
                rec = cycle.run_one(jr, claim, backend=self.backend, progress=self.progress, hooks=hooks)
            except HostLacks as e:
                return self.leave_out(q, lease, jr, e)
            except (InfraError, OSError) as e:
                # Before its container started: back to the queue. This host's failure (its engine
                # not answering, a create refused, its disk full while it writes the job's journal)
                # spends none of the task's tries, which are not one host's to spend: on a queue
                # with several runners a sick one would fail every task it claims. A missing image
                # counts: the task's engine's was checked (check_host), so it is a fallback's or
                # the check's, which it would otherwise claim and hand back forever; after its
                # tries the task fails with the command that builds it, as on the file queue.
                err = e if isinstance(e, InfraError) else InfraError(f"task {tid}: this host: {e}")
                if not hooks.marked and not hooks.lost.is_set():
                    said = f"{err}" + (f"; {err.hint}" if isinstance(e, ImageMissing) and err.hint else "")
                    info = ErrorInfo(kind=ErrorKind.infra, message=said)
                    with contextlib.suppress(FilaError):
                        hand_back(
                            q,
                            lease,
                            jr,
                            info,
                            counted=isinstance(e, ImageMissing),
                            backoff_s=INFRA.backoff(1),
                        )
                if err is e:
                    raise
                raise err from e
            ended = rec is not None
            if hooks.lost.is_set() or rec is None:
                self.progress(f"{tid}: lease lost; nothing published")
                return None
            try:
                return publish(q, lease, jr, manifest, rec, self.progress, signer=self.signer)
            except Refused as e:  # its record changed outside fila meanwhile: a person's to decide
                self.progress(f"{tid}: {e}; nothing published")
                return None
        finally:
            renewer.stop.set()
            renewer.join(timeout=5)
            # The job root goes only after a run that ended with its record, or one that never
            # reached its started mark, and once the engine confirms no container of it is left:
            # else (fenced off, lease lost, the engine not answering) it is kept, its lock let go,
            # for recovery to remove its containers and then it (remote_jobs.py).
            if jr is not None and not self.keep and not hooks.lost.is_set() and (ended or not hooks.marked):
                with contextlib.suppress(FilaError, OSError):
                    if self.backend.find(root=str(jr.path)) == []:
                        remote_jobs.remove(jr.path)
            if (
                jr is not None
                and not self.keep
                and any(os.path.lexists(p) for p in (jr.path, remote_jobs.removing(jr.path)))
            ):
                self.kept.add(str(jr.path))
            if held is not None:
                held.release()
