"""The circuit breaker (docs/architecture.md, "The queue's contract"): stop claiming after too many failures.

Workers count consecutive outcomes that are `failed` or `needs_human`; a `needs_review` resets
the count; an invalid task file, a task handed back and a run a person interrupted do not count.
When the count reaches the policy's `max_consecutive_failures` (of the task that failed) the
breaker opens: no worker of this queue root claims again until a person runs `fila rearm`. There
is no automatic half-open.

The state is one file, `fila/state/breaker.json`, written durably under a lock, and shared by
every worker of the root: a restarted worker must not forget that the queue was stopped. Trips
and rearms are appended to `fila/state/breaker.events.jsonl`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ..core import fsutil
from ..core.fsutil import file_lock
from ..core.layout import Root
from ..core.models import ErrorKind, Policy, Record, Status, now_iso

DEFAULT_THRESHOLD = Policy.model_fields["max_consecutive_failures"].default
RECENT = 20  # the counted failures' ids kept


class BreakerState(BaseModel):
    open: bool = False
    consecutive: int = 0
    threshold: int = DEFAULT_THRESHOLD
    recent: list[str] = Field(default_factory=list, description="ids of the counted failures")
    tripped_at: str | None = None
    tripped_by: str | None = None
    reason: str | None = None
    rearmed_at: str | None = None
    rearmed_by: str | None = None
    updated_at: str | None = None


def path(root: Root) -> Path:
    return root.state_dir / "breaker.json"


def events_path(root: Root) -> Path:
    return root.state_dir / "breaker.events.jsonl"


@contextlib.contextmanager
def _locked(root: Root) -> Iterator[None]:
    root.state_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(root.state_dir / ".breaker.lock"):
        yield


def read(root: Root) -> BreakerState:
    try:
        return BreakerState.model_validate_json(path(root).read_bytes())
    except FileNotFoundError:
        return BreakerState()


def _write(root: Root, state: BreakerState) -> None:
    state.updated_at = now_iso()
    fsutil.atomic_write(path(root), state.model_dump_json(indent=2) + "\n")


def _event(root: Root, event: str, **data: object) -> None:
    fsutil.append_line(events_path(root), json.dumps({"at": now_iso(), "event": event, **data}, default=str))


def verdict(rec: Record) -> Literal["success", "failure"] | None:
    """How an outcome counts: None for what says nothing about the engine or the host."""
    if rec.status == Status.needs_review:
        return "success"
    if rec.status == Status.failed and rec.error is not None and rec.error.kind == ErrorKind.invalid:
        return None  # a bad task file is its author's problem, not a sick worker's
    if rec.error is not None and rec.error.kind == ErrorKind.interrupted:
        return None  # a person stopped the worker (Ctrl-C, SIGTERM): nothing is sick
    if author_chosen(rec):
        return None
    if rec.status in (Status.failed, Status.needs_human):
        return "failure"
    return None


def author_chosen(rec: Record) -> bool:
    """An outcome the task's author decides, which says nothing about the host or an engine: a
    timeout the task set itself (`"timeout": 1000` on a command that sleeps), or the shell
    engine's command exiting non-zero (`false`; the shell engine is only `sh -c` around the
    author's program). Counting them let anyone who can submit five tasks stop the queue for
    everyone. A timeout under the policy's default and a real engine's failure still count."""
    if rec.status != Status.failed or rec.error is None:
        return False
    if rec.error.kind == ErrorKind.timeout:
        return rec.task is not None and rec.task.timeout is not None
    return (
        rec.error.kind == ErrorKind.engine_error and rec.engine == "shell" and rec.exit_code not in (None, 0)
    )


def threshold(root: Root, policy: str | None) -> int:
    """`max_consecutive_failures` of policy `policy` ("default" when None) under `root`: the
    threshold a failure of a task of that policy counts against, on either queue (the file queue's
    worker and a PostgreSQL runner read it from their own root); the default when the policy
    does not load."""
    from .policy import load_policy

    try:
        return load_policy(root, policy or "default")[0].max_consecutive_failures
    except Exception:  # a policy that no longer loads must not stop the count
        return DEFAULT_THRESHOLD


@dataclass(frozen=True)
class Step:
    """One outcome counted (`step`): the breaker's new state, whether it changed (to be
    written) and whether it opened at this outcome (a `tripped` event, `trip_data`)."""

    state: BreakerState
    changed: bool = False
    tripped: bool = False


def step(st: BreakerState, rec: Record, *, threshold: int, by: str, at: str) -> Step:
    """The counting rules, the same for both queues and pure (each store reads and writes the
    state under its own lock): outcome `rec` (`verdict`) counted on state `st`. A success resets
    the count, a failure adds one (its id kept among the last RECENT) and opens the breaker when
    the count reaches `threshold` (the failing task's policy's); `by` (the worker or runner) and
    `at` (its clock, as the records write it) name the trip. `st` itself is not changed."""
    v = verdict(rec)
    if v is None:
        return Step(st)
    if v == "success":
        if not (st.consecutive or st.recent):
            return Step(st)
        return Step(st.model_copy(update={"consecutive": 0, "recent": []}), changed=True)
    new = st.model_copy(
        update={
            "consecutive": st.consecutive + 1,
            "recent": [*st.recent, rec.id][-RECENT:],
            "threshold": threshold,
        }
    )
    if new.open or new.consecutive < new.threshold:
        return Step(new, changed=True)
    new.open, new.tripped_at, new.tripped_by = True, at, by
    new.reason = (
        f"{new.consecutive} consecutive tasks failed or need a person "
        f"(max_consecutive_failures {new.threshold}); last: {rec.id}"
    )
    return Step(new, changed=True, tripped=True)


def trip_data(st: BreakerState) -> dict[str, object]:
    """What a `tripped` event records besides who tripped it: the count, its threshold, its tasks."""
    return {"consecutive": st.consecutive, "threshold": st.threshold, "tasks": st.recent}


def record(root: Root, rec: Record, *, worker: str) -> BreakerState:
    """Count one outcome (`step`); opens the breaker at the threshold. Returns the new state."""
    v = verdict(rec)
    if v is None:
        return read(root)
    # Only a failure is counted against a threshold: a success reads no policy.
    limit = threshold(root, rec.task.policy if rec.task else None) if v == "failure" else DEFAULT_THRESHOLD
    with _locked(root):
        done = step(read(root), rec, threshold=limit, by=worker, at=now_iso())
        if done.changed:
            _write(root, done.state)
        if done.tripped:
            _event(root, "tripped", worker=worker, **trip_data(done.state))
        return done.state


def rearm(root: Root, *, by: str, reason: str | None = None) -> BreakerState:
    """A person's decision to let workers claim again: resets the count, and is recorded."""
    with _locked(root):
        st = read(root)
        was = st.model_dump()
        st = BreakerState(rearmed_at=now_iso(), rearmed_by=by, threshold=st.threshold)
        _write(root, st)
        _event(
            root,
            "rearmed",
            by=by,
            reason=reason,
            was_open=was["open"],
            consecutive=was["consecutive"],
            tasks=was["recent"],
        )
        return st
