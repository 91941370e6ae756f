"""A claim of the PostgreSQL queue as the run path sees it (docs/architecture.md, "A runner"):
`LeaseHooks`, the run path's hooks for one database lease (the started mark just before the
container, a stop at the next check once the lease is lost or the runner is stopping), and
`Renewer`, the thread that renews that lease while the job runs.
"""

from __future__ import annotations

import threading
import time

from ..core.errors import FilaError, Refused
from ..queue import store as queue
from ..queue.pg.store import Lease, PgQueue
from .claimed import Hooks, Interrupted


class LeaseHooks(Hooks):
    """The run path's hooks for one database lease: the started mark before the container, and
    a stop at the next check once the lease is lost or the runner is stopping."""

    claim_said = True  # run/remote.py says it as it takes the lease, with the token

    def __init__(
        self, q: PgQueue, lease: Lease, cancel: threading.Event, ttl: float, sent: float | None = None
    ) -> None:
        """`ttl`: the lease's length; the lease counts as lost once `ttl` (less a tenth) has passed
        on this host's monotonic clock since the claim (`sent`: when the claim was sent; now when
        not known) or the last renewal that succeeded was sent (`renewed`), whether or not a
        renewal is still waiting for its answer: a renewal blocked on a silent network, or a
        claim whose answer came late, cannot keep a container running past the lease."""
        self.q, self.lease, self.cancel = q, lease, cancel
        self.lost = threading.Event()
        self.marked = False
        self.ttl = ttl
        self.valid_until = (time.monotonic() if sent is None else sent) + self.ttl * 0.9

    def renewed(self, sent: float) -> None:
        """A renewal sent at monotonic time `sent` succeeded: the lease holds until sent + ttl."""
        self.valid_until = max(self.valid_until, sent + self.ttl * 0.9)

    def check(self) -> None:
        if not self.lost.is_set() and time.monotonic() >= self.valid_until:
            self.lost.set()
        if self.lost.is_set():
            raise queue.LeaseLost(f"task {self.lease.task_id}: token {self.lease.token} lost its lease")
        if self.cancel.is_set():
            raise Interrupted("the runner is stopping")

    def before_start(self, container: str) -> None:
        """The started mark, once per claim: a fallback engine's or the check's container later
        in the same run crosses no new boundary (the lease is checked all the same)."""
        self.check()
        if self.marked:
            return
        try:
            self.q.mark_started(self.lease.task_id, self.lease.token, container=container)
        except queue.LeaseLost:
            self.lost.set()
            raise
        except Refused as e:  # its record changed outside fila: not this runner's to run any more
            self.lost.set()
            raise queue.LeaseLost(str(e)) from e
        self.marked = True


class Renewer(threading.Thread):
    """Renews one lease every `every` seconds; sets `hooks.lost` when the database refuses it, or
    when no renewal succeeded before the last granted lease ran out (measured on this host's
    monotonic clock from the moment the renewal was sent: an under-estimate of the database's)."""

    def __init__(self, q: PgQueue, hooks: LeaseHooks, ttl: float, claim: queue.Claim | None) -> None:
        super().__init__(name=f"fila-lease-{hooks.lease.task_id}", daemon=True)
        self.q, self.hooks, self.ttl, self.claim = q, hooks, ttl, claim
        self.stop = threading.Event()

    def run(self) -> None:
        lease = self.hooks.lease
        while not self.stop.wait(self.ttl / 3):
            if self.claim is not None:
                queue.heartbeat(self.claim)
            sent = time.monotonic()
            try:
                self.q.renew(lease.task_id, lease.token, self.ttl)
                self.hooks.renewed(sent)
                self.q.runner_beat(lease.runner)
            except queue.LeaseLost:
                self.hooks.lost.set()
                return
            except FilaError:
                if time.monotonic() >= self.hooks.valid_until:
                    self.hooks.lost.set()
                    return
