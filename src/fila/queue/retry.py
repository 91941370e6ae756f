"""One retry policy: how many attempts, how long to back off between them, what counts as
transient (docs/architecture.md, "The queue's contract").

An infrastructure error before a task's container started sends the task back to the queue with
a backoff, and so does a worker that died before its container started; both count toward one
limit of attempts, after which the task fails. The job runner (run/claimed.py) requeues with `INFRA`,
recovery (recovery/claims.py) requeues a dead worker's task with it, recovery/records.py clamps a
backoff longer than its cap (a clock that went back), and `run --once` waits for a backoff at most
that cap.

The worker's probe of an unreachable container daemon (run/worker.py) is the same kind of policy,
a capped exponential backoff after a transient error, so it is an instance of the same class:
without an attempt limit (the worker waits for the daemon until it answers or a person stops the
worker) and without jitter (one worker pings one daemon: there is no crowd to spread out).

A person's `fila retry ID` (queue/store.py's `retry`) is something else: a decision, not a policy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.errors import InfraError

if TYPE_CHECKING:
    from ..core.models import Record

# The outcomes of an attempt that ended before its container started through no fault of the
# task: an infrastructure error (`requeued`) or a dead worker (`lost`). A worker that was asked to
# stop hands its task back (`handed back`), which does not count.
COUNTED = ("requeued", "lost")


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` in all (the attempt that reaches it fails instead of retrying; None: no limit),
    the backoff after attempt n `base` * 2**(n-1) seconds capped at `cap`, drawn uniformly below
    that with `jitter` (full jitter: workers that failed together do not retry together)."""

    attempts: int | None
    base: float
    cap: float
    jitter: bool = True

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th failed attempt (1 is the first)."""
        ceiling = min(self.cap, self.base * 2 ** max(0, attempt - 1))
        return random.uniform(0, ceiling) if self.jitter else ceiling

    def gives_up(self, attempt: int) -> bool:
        """True when the `attempt`-th failed attempt is the last one allowed."""
        return self.attempts is not None and attempt >= self.attempts

    @staticmethod
    def transient(err: BaseException, *, refused: bool = False) -> bool:
        """Whether `err`, raised before the task's container started, is worth another attempt:
        an infrastructure error (the daemon did not answer, an engine's image is not built yet),
        unless the container engine refused the request itself (`refused`: the task's own fault,
        the same on every attempt)."""
        return isinstance(err, InfraError) and not refused

    @staticmethod
    def tries(rec: Record | None) -> int:
        """The attempts of the task that count toward the limit (COUNTED)."""
        return sum(1 for a in rec.attempts if a.outcome in COUNTED) if rec else 0


# Infrastructure errors before a task's container started: five attempts, backoff up to a minute.
INFRA = RetryPolicy(attempts=5, base=1.0, cap=60.0)
