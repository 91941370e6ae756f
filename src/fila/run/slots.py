"""The slot loop both workers share: the file queue's (run/worker.py) and the PostgreSQL queue's
runner (run/remote.py) each run up to `concurrency` claimed tasks at once, each in a thread of its
own, and collect the ended ones in their main loop, one at a time (docs/architecture.md, `run/`).

`SlotLoop` holds what the two loops have in common: the running slots, the event a job that ends
(or a signal) sets to wake the loop, what the run ended with (its records, a host failure, a fila
bug, an interrupt, the breaker found open) and the one exit rule, `run_exit_code`. How a task is
claimed, steered and recovered stays with each worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ..core.errors import (
    EXIT_BREAKER,
    EXIT_DOCKER,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_SOME_FAILED,
    FilaError,
)
from ..core.models import ErrorKind, Record, Status

RECOVER_EVERY_S = 30.0  # how often a worker's recovery pass runs again while it runs
KEPT = 100  # records a long-running worker keeps (the newest): its exit code reads none


class Slot:
    """One claimed task's job in a thread of its own: what it ended with, for the main loop."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.result: Record | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None


S = TypeVar("S", bound=Slot)


class SlotLoop(Generic[S]):
    """Up to `concurrency` jobs at once, each in a thread; the worker's main loop starts them
    (`start`), takes the ended ones (`ended`) and sleeps until one ends or `timeout` (`wait`).
    `S`: the worker's kind of slot (the file worker's are its jobs' hooks too)."""

    def __init__(self, *, concurrency: int, once: bool, on_record: Callable[[Record], None]) -> None:
        self.concurrency, self.once, self.on_record = max(1, concurrency), once, on_record
        self.active: dict[str, S] = {}
        self.wake = threading.Event()  # a job ended, or a signal: the main loop looks again
        self.records: list[Record] = []  # `once`: all of this run's; else the newest KEPT
        self.infra_error: FilaError | None = None  # the host failed a job (`once`: exit 3)
        self.crash: BaseException | None = None  # a fila bug in a job
        self.interrupted = False  # Ctrl-C: exit 130
        self.breaker_tripped = False  # the circuit breaker found open (said once)
        self.stop_claiming = False

    def start(self, key: str, slot: S, work: Callable[[], Record | None]) -> None:
        """Run `work` for `slot` in a thread of its own, held in `active` under `key` until it ends;
        what it returns or raises is the slot's `result` or `error` (a thread cannot raise to the
        loop), and its end wakes the loop."""

        def run() -> None:
            try:
                slot.result = work()
            except BaseException as e:  # reported by the main loop
                slot.error = e
            finally:
                slot.done.set()
                self.wake.set()

        slot.thread = threading.Thread(target=run, name=f"fila-job-{slot.task_id}", daemon=True)
        self.active[key] = slot
        slot.thread.start()

    def ended(self) -> list[S]:
        """The slots whose job ended, in the order they started, out of `active`."""
        out = []
        for key, slot in list(self.active.items()):
            if slot.done.is_set():
                if slot.thread is not None:
                    slot.thread.join()
                del self.active[key]
                out.append(slot)
        return out

    def join(self, timeout: float | None = None) -> None:
        """Wait for every running job's thread (each up to `timeout`)."""
        for slot in list(self.active.values()):
            if slot.thread is not None:
                slot.thread.join(timeout=timeout)

    def wait(self, timeout: float) -> None:
        """Sleep until a job ends, a signal or `timeout` seconds."""
        self.wake.wait(timeout)
        self.wake.clear()

    def record(self, rec: Record) -> None:
        """`rec` is this run's: said, and kept for the exit code (`once`; a long-running worker
        exits 0 whatever its records, and keeps only the newest: nothing grows per task)."""
        self.records.append(rec)
        if not self.once:
            del self.records[:-KEPT]
        self.on_record(rec)

    def exit_code(self) -> int:
        return run_exit_code(
            self.records,
            once=self.once,
            interrupted=self.interrupted,
            breaker_tripped=self.breaker_tripped,
            infra_error=self.infra_error is not None,
            crash=self.crash is not None,
        )


def run_exit_code(
    records: Iterable[Record],
    *,
    once: bool = True,
    interrupted: bool = False,
    breaker_tripped: bool = False,
    infra_error: bool = False,
    crash: bool = False,
) -> int:
    """The one exit rule of `fila run` and `fila worker` on either queue, and of `submit --run`
    (README, "Exit codes"; docs/scale-out.md): 130 interrupted; with `once`, 6 the breaker open and
    3 Docker or an image missing; 1 a fila bug in a job; else, without `once`, 0. With `once`, of
    the `records`: 1 when one failed or needs a person other than as invalid, else 2 when one was
    refused as invalid, else 0 (a failure a person must look at outranks a task file to fix)."""
    if interrupted:
        return EXIT_INTERRUPTED
    if once and breaker_tripped:
        return EXIT_BREAKER
    if once and infra_error:
        return EXIT_DOCKER
    if crash:
        return EXIT_SOME_FAILED
    if not once:
        return EXIT_OK
    recs = list(records)
    if any(r.status in (Status.failed, Status.needs_human) and not _invalid(r) for r in recs):
        return EXIT_SOME_FAILED
    return EXIT_INVALID if any(_invalid(r) for r in recs) else EXIT_OK


def _invalid(rec: Record) -> bool:
    return rec.status == Status.failed and rec.error is not None and rec.error.kind == ErrorKind.invalid
