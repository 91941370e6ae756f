"""The worker loop: claim -> run -> record -> claim the next -> queue empty ->
idle -> a task appears -> wake within a second -> run it. No restart between tasks.

- `concurrency` jobs at once, each in its own thread; the backend (sandbox/) gives each call
  its own connection, so one job's engine calls never wait for another's.
- Wake-up: inotify on fila/in/ (and fila/state/, for `fila rearm`) through inotify_simple; a
  one-second poll is the fallback where inotify is missing.
- Recovery runs in a background thread at start and then periodically: start-up never waits
  for it (the boot path is not the place for work).
- The circuit breaker (queue/breaker.py) is checked before every claim.
- Docker unreachable: no claims; the daemon is probed with capped exponential backoff
  (DAEMON_PROBE, a policy of queue/retry.py), and recovery runs again once it answers. With
  `once`, the worker stops and reports it (exit 3).
- Signals: SIGTERM drains (no new claims; a job whose container has not started is handed back;
  running jobs get `grace_s` to finish, then are stopped as on Ctrl-C); SIGINT (Ctrl-C) or a
  second SIGTERM stops every job at once: containers are removed, a started task becomes
  `needs_human`, an unstarted one goes back to the queue. Handlers only set flags: no half-done
  rename or record write, and the job threads finish their own writes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineUnavailable, ImageMissing, InfraError
from ..core.layout import Root
from ..core.models import Record, Status
from ..queue import breaker, lease, retry
from ..queue import store as queue
from . import job as cycle
from . import spares
from .slots import RECOVER_EVERY_S, Slot, SlotLoop

if TYPE_CHECKING:
    from ..sandbox import Backend

DEFAULT_GRACE_S = 60.0
# The probe of an unreachable daemon: 1, 2, 4 ... 30 s apart, for as long as it takes (see
# queue/retry.py for why it is the same kind of policy as a task's).
DAEMON_PROBE = retry.RetryPolicy(attempts=None, base=1.0, cap=30.0, jitter=False)


def process_age() -> float | None:
    """Seconds since this process was started (interpreter start-up and imports included), from
    /proc at 10 ms resolution; None where there is no /proc."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22 (starttime, clock ticks since boot) counted after the ")" that ends the name.
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _Job(cycle.Hooks, Slot):
    """One claimed task running in its own slot; the worker steers it through these hooks."""

    def __init__(self, worker: Worker, claim: queue.Claim, before: dict[str, float] | None = None) -> None:
        super().__init__(claim.task_id)
        self.worker, self.claim = worker, claim
        self.before = before or {}
        self.cancel = threading.Event()
        self.lost = threading.Event()  # set by the heartbeat thread when the claim file is gone

    def check(self) -> None:
        if self.lost.is_set():
            raise queue.LeaseLost(f"{self.claim.name}: the claim is gone (reaped)")
        if self.cancel.is_set():
            raise cycle.Interrupted(self.worker.stop_reason)

    def timings(self) -> dict[str, float]:
        return self.before

    def before_start(self, container: str) -> None:
        self.check()
        if self.worker.draining:
            raise cycle.Interrupted("the worker is stopping; handed back before its container started")

    def run(self) -> Record | None:
        """The job, in its slot's thread: the engine asked first (one that does not answer gets
        the task handed back, never begun), then the one run path."""
        w = self.worker
        try:
            w.backend.ping()
        except EngineUnavailable as e:
            queue.hand_back(w.root, self.claim, log={"reason": e.message})
            raise
        return cycle.run_one(w.root, self.claim, backend=w.backend, progress=w.progress, hooks=self)


class _Watcher(threading.Thread):
    """Sets `wake` when a file appears in one of `dirs` (inotify); inert where unavailable."""

    def __init__(self, dirs: list[Any], wake: threading.Event) -> None:
        super().__init__(name="fila-watch", daemon=True)
        self.wake, self.stop = wake, threading.Event()
        self.ino: Any = None
        try:
            from inotify_simple import INotify, flags

            ino = INotify()
            mask = flags.CREATE | flags.MOVED_TO | flags.CLOSE_WRITE
            for d in dirs:
                ino.add_watch(str(d), mask)
            self.ino = ino
        except (ImportError, OSError):
            self.ino = None  # polling it is

    def run(self) -> None:
        try:
            while self.ino is not None and not self.stop.is_set():
                try:
                    if self.ino.read(timeout=500):
                        self.wake.set()
                except OSError:
                    return
        finally:
            if self.ino is not None:
                with contextlib.suppress(OSError):
                    self.ino.close()

    def close(self) -> None:
        """Stop watching, without waiting: the thread sees `stop` within its read timeout and
        closes the inotify fd itself (joining it cost up to 0.5 s on every `fila run --once`)."""
        self.stop.set()
        if not self.is_alive() and self.ino is not None:
            with contextlib.suppress(OSError):
                self.ino.close()


class Worker(SlotLoop[_Job]):
    def __init__(
        self,
        root: Root,
        *,
        once: bool = False,
        concurrency: int = 1,
        worker_id: str | None = None,
        backend: Backend | None = None,
        on_record: Callable[[Record], None] = lambda _r: None,
        progress: Callable[[str], None] = lambda _m: None,
        poll_s: float = 1.0,
        grace_s: float = DEFAULT_GRACE_S,
        recover_every_s: float = RECOVER_EVERY_S,
        only: set[str] | None = None,
        startup: bool = True,
        detach_teardown: bool = False,
    ) -> None:
        """`startup`: with `once`, the first task's timings get the process's start-up (False
        in a long-lived process that runs many: docs/api.md: after its first run).
        `detach_teardown`: the process exits once this returns (the CLI's `--once` forms): the
        gateways still being removed are left to a detached reaper instead of waited for
        (run/spares.close)."""
        from ..sandbox import get_backend, root_backend

        super().__init__(concurrency=concurrency, once=once, on_record=on_record)
        self.root = root
        self.id = worker_id or queue.new_worker_id()
        self.owns_backend = backend is None
        self.backend = backend or get_backend(root_backend(root))
        self.progress, self.poll_s = progress, poll_s
        self.grace_s, self.recover_every_s = grace_s, recover_every_s
        # These task ids only (`fila submit --run`): other queued tasks are left to other workers.
        self.only = only
        # `once` (CI): the first task's timings get the process's start-up (a long-running
        # worker's start is not a task's cost).
        self.first_claim = once
        self.count_startup = startup
        self.detach_teardown = detach_teardown
        self.recover_now = threading.Event()
        self.stopped = threading.Event()
        self.recovering = threading.Event()
        self.draining = self.cancelling = False
        self.stop_reason = "the worker is stopping"
        self.drain_deadline: float | None = None
        self.docker_bad = False
        self.docker_retry_at = 0.0
        self.docker_failures = 0  # failed probes since the daemon last answered

    # -- signals (handlers only set flags) ------------------------------------------------

    def request_stop(self, *, cancel: bool, reason: str) -> None:
        if cancel:
            self.cancelling = True
        elif not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.grace_s
        self.stop_reason = reason
        self.wake.set()

    def _on_sigterm(self, _sig: int, _frame: Any) -> None:
        self.request_stop(cancel=self.draining, reason="the worker received SIGTERM")

    def _on_sigint(self, _sig: int, _frame: Any) -> None:
        self.interrupted = True
        self.request_stop(cancel=True, reason="the worker was interrupted (Ctrl-C)")

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Process the queue; returns the exit code (`fila.cli` lists them). `once`: until it is empty."""
        self.root.require()
        if self.once:
            self.backend.ping()  # an engine that does not answer: fail before claiming
        lock = lease.WorkerLock(self.root, self.id).acquire()
        pool = spares.keep(self.root, self.backend, once=self.once, only=self.only)
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {
                signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
                signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint),
            }
        # `once` never waits for a new file (only for its own jobs, a backoff or recovery): no
        # inotify watch or thread.
        watcher = None if self.once else _Watcher([self.root.in_dir, self.root.state_dir], self.wake)
        if watcher is not None:
            watcher.start()
        helpers = [
            threading.Thread(target=self._heartbeats, name="fila-heartbeat", daemon=True),
            threading.Thread(target=self._recovery, name="fila-recovery", daemon=True),
        ]
        self.recovering.set()
        for t in helpers:
            t.start()
        if watcher is not None:
            self.progress(
                f"fila worker {self.id}: watching {self.root.in_dir}" + ("" if watcher.ino else " (polling)")
            )
        try:
            self._loop()
        except BaseException:
            # A bug or a broken stdout in the loop: stop the jobs as on Ctrl-C (containers
            # removed, tasks recorded) before the exception ends the process.
            self.request_stop(cancel=True, reason="the worker failed")
            for job in list(self.active.values()):
                job.cancel.set()
            self.join(timeout=120)
            raise
        finally:
            self.stopped.set()
            self.wake.set()
            self.recover_now.set()
            if watcher is not None:
                watcher.close()
            for t in helpers:
                t.join(timeout=30)
            for sig, h in handlers.items():
                signal.signal(sig, h)
            spares.close(pool, self.backend, self.progress, detach=self.detach_teardown)
            if self.owns_backend:
                self.backend.close()
            lock.release()
        return self.exit_code()

    def _loop(self) -> None:
        while True:
            self._collect()
            if (
                self.draining
                and not self.cancelling
                and self.drain_deadline
                and time.monotonic() > self.drain_deadline
            ):
                self.request_stop(
                    cancel=True, reason=f"the worker's {self.grace_s:g} s grace after SIGTERM ran out"
                )
            if self.cancelling:
                for job in self.active.values():
                    job.cancel.set()
            if self.draining or self.cancelling or self.stop_claiming:
                if not self.active:
                    return
                self.wait(0.5)
                continue
            if breaker.read(self.root).open:
                if not self.breaker_tripped:
                    self.breaker_tripped = True
                    self.progress(
                        f"fila worker: circuit breaker open: "
                        f"{breaker.read(self.root).reason}; run `fila rearm`"
                    )
                if self.once:
                    self.stop_claiming = True
                    continue
                self.wait(self.poll_s)
                continue
            self.breaker_tripped = False
            if not self._docker_ready():
                self.wait(min(self.poll_s, max(0.05, self.docker_retry_at - time.monotonic())))
                continue
            started = self._fill()
            if self.once and not self.active and not started and self.only:
                if self._only_pending():
                    self.wait(self.poll_s)
                elif self.recovering.is_set():
                    self.wait(0.1)
                else:
                    return
                continue
            if self.once and not self.active and not started:
                wake_at = cycle.earliest_backoff(self.root)
                if wake_at is not None:
                    self.wait(max(0.05, min(wake_at - time.time(), retry.INFRA.cap)))
                elif self.recovering.is_set():
                    self.wait(0.1)
                else:
                    return
                continue
            wake_at = cycle.earliest_backoff(self.root)
            timeout = self.poll_s if wake_at is None else min(self.poll_s, wake_at - time.time())
            self.wait(max(0.05, timeout))

    def _only_pending(self) -> bool:
        """`only`: True while one of its tasks is queued (a backoff) or run by another worker
        (it won the claim); a task another worker finished is reported as this run's."""
        pending = False
        for tid in sorted(self.only or ()):
            rec = queue.read_record(self.root, tid)
            if rec is None or rec.status in (Status.queued, Status.running):
                pending = pending or rec is not None or (self.root.in_dir / f"{tid}.json").exists()
            elif all(r.id != tid for r in self.records):
                self.record(rec)
        return pending

    def _fill(self) -> int:
        started = 0
        while len(self.active) < self.concurrency:
            age = process_age() if self.first_claim and self.count_startup else None
            t = time.monotonic()
            claim = cycle.next_claim(self.root, self.id, self.progress, only=self.only)
            if claim is None:
                break
            before = {"claim": round(time.monotonic() - t, 3)}
            if age is not None:  # the process's start-up up to its first claim: imports, client, lock
                before = {"startup": round(age, 3), **before}
            if self.first_claim:
                # What the job asks the engine only at its prepare step (Docker: GET /info, 10-30
                # ms), asked now in the background while the job reads and checks its task.
                threading.Thread(target=self._ask_overlay, name="fila-overlay-probe", daemon=True).start()
            self.first_claim = False
            job = _Job(self, claim, before)
            self.start(claim.name, job, job.run)
            started += 1
        return started

    def _ask_overlay(self) -> None:
        with contextlib.suppress(Exception):  # the job asks again, and reports what fails
            self.backend.overlay_unsupported()

    def _collect(self) -> None:
        for job in self.ended():
            if job.error is not None:
                self._job_failed(job)
            rec = job.result
            if rec is None or rec.status in (Status.queued, Status.running):
                continue
            self.record(rec)
            st = breaker.record(self.root, rec, worker=self.id)
            if st.open and not self.breaker_tripped:
                self.breaker_tripped = True
                self.progress(
                    f"fila worker: circuit breaker tripped: {st.reason}; no more claims until `fila rearm`"
                )

    def _job_failed(self, job: _Job) -> None:
        e = job.error
        tid = job.claim.task_id
        if isinstance(e, InfraError):
            self.progress(f"{tid}: {e}" + (f"\n  hint: {e.hint}" if e.hint else ""))
            if self.once and isinstance(e, ImageMissing):
                # An engine's image not built yet is that task's wait (requeued with backoff, and
                # failed once retry.INFRA gives up): the run goes on, the other tasks still run.
                # The attempt that gave up left the task failed: its record is this run's.
                rec = queue.read_record(self.root, tid)
                if rec is not None and rec.status not in (Status.queued, Status.running):
                    job.result = rec
                return
            if self.once:
                self.infra_error = self.infra_error or e
                self.stop_claiming = True
            elif not self._docker_answers():
                self._docker_down()
            return
        self.progress(f"{tid}: fila bug: " + "".join(traceback.format_exception(e)))
        self.crash = self.crash or e
        if self.once:
            self.stop_claiming = True

    # -- Docker health ------------------------------------------------------------------------

    def _docker_answers(self) -> bool:
        try:
            self.backend.ping()
            return True
        except EngineUnavailable:
            return False

    def _docker_down(self) -> None:
        if not self.docker_bad:
            self.progress("fila worker: Docker does not answer; no claims until it does")
        self.docker_bad = True
        self.docker_failures += 1
        self.docker_retry_at = time.monotonic() + DAEMON_PROBE.backoff(self.docker_failures)

    def _docker_ready(self) -> bool:
        if not self.docker_bad:
            return True
        if time.monotonic() < self.docker_retry_at:
            return False
        if not self._docker_answers():
            self._docker_down()
            return False
        self.progress("fila worker: Docker answers again")
        self.docker_bad, self.docker_failures = False, 0
        self.recover_now.set()  # remove what the outage left behind
        return True

    # -- helpers ------------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        """The one heartbeat writer: refreshes the lease of every claim this process holds,
        whatever phase its job is in (copying a large project, the container's run, the diff).
        The cycle's in-run callback only checks that the claim is still held."""
        while not self.stopped.wait(lease.HEARTBEAT_S):
            for job in list(self.active.values()):
                if not queue.heartbeat(job.claim):
                    # Reaped (or won/handed back by the job itself, after which it checks
                    # nothing): the job's next check raises LeaseLost.
                    job.lost.set()

    def _recovery(self) -> None:
        from ..recovery.recover import recover

        while True:
            try:
                # The worker's backend: its pooled, already checked connection.
                rep = recover(self.root, backend=self.backend, wait=False)
                for a in rep.actions:
                    self.progress(f"fila recover: {a.task_id or '-'}: {a.action}: {a.detail}")
                if rep.actions:
                    self.wake.set()
            except Exception as e:  # recovery is retried on the next round
                self.progress(f"fila recover: failed: {e}")
            finally:
                self.recovering.clear()
                self.wake.set()  # a `once` loop waiting for this pass to end exits now, not at its next poll
            if self.once and not self.only:
                return  # `only` may wait for another worker's claim: recovery settles a dead one
            self.recover_now.wait(self.recover_every_s)
            self.recover_now.clear()
            if self.stopped.is_set():
                return
